"""The in-process cluster: the same router and worker apps as the processes, over real HTTP on 127.0.0.1, with KV
handed from the prefill pool to the decode pool over NIXL inside one process."""

import socket
import threading

import pytest
from probes import HTTP, internal_headers, metric_total

from pdserve import LLM, SamplingParams
from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig

TIMEOUT_S = 60.0


def step_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("rank-") and t.name.endswith("-step")}


def test_a_disaggregated_request_gets_the_offline_engine_tokens_and_the_cluster_stops_clean(tiny_v2):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=1, num_decode=1, worker_args=("--dtype", "float32"))
    prompt = list(range(7, 7 + 45))
    expected = LLM(tiny_v2, progress=False, dtype="float32").generate(
        prompt_token_ids=[prompt], sampling=SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    threads_before = step_threads()  # other clusters of this session may be running
    with InProcessCluster(cfg) as cluster:
        prefill, decode = cluster.workers
        model = HTTP.get(cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
        response = HTTP.post(cluster.url + "/v1/completions", timeout=TIMEOUT_S, json={
            "model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == expected.token_ids
        # The prompt was prefilled on one worker and its KV written to the other's pool.
        assert prefill.name.startswith("prefill") and decode.name.startswith("decode")
        assert metric_total(prefill.url, "pdserve_kv_transfer_seconds_count") >= 1
        # The internal API is closed without the credential, as in a worker process.
        assert HTTP.get(decode.url + "/internal/v1/info", timeout=TIMEOUT_S).status_code == 401
        assert HTTP.get(decode.url + "/internal/v1/info", headers=internal_headers(),
                         timeout=TIMEOUT_S).status_code == 200
        ports = [int(part.url.rsplit(":", 1)[1]) for part in (cluster.router, *cluster.workers)]
        assert len(step_threads()) == len(threads_before) + 2
    assert step_threads() <= threads_before  # every rank's step thread of this cluster has ended
    for port in ports:  # and nothing listens any more
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0


def test_an_expert_parallel_worker_is_refused_before_anything_starts(tiny_v2):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=0, num_decode=0, num_both=1, ranks_per_worker=2,
                        worker_args=("--expert-parallel",), start_timeout_s=30)
    with pytest.raises(ValueError, match="process per rank"):
        InProcessCluster(cfg).__enter__()
