"""A scalable cluster's pools grow and shrink while it serves: the router and the workers follow endpoint files, a
new decode worker takes requests (with KV handed to it), a removed one finishes what it runs first and no request
fails on the way."""

import threading
import time

import httpx
import pytest
from probes import HTTP, metric_total

from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig
from pdserve.discovery.endpoints import FileDiscovery, write_endpoints_file

TIMEOUT_S = 60.0


def test_file_discovery_follows_the_file_and_treats_a_missing_one_as_empty(tmp_path):
    path = str(tmp_path / "workers")
    discovery = FileDiscovery(path)
    assert discovery.endpoints() == []
    write_endpoints_file(path, ["http://127.0.0.1:1/", "http://127.0.0.1:2"])
    assert [e.url for e in discovery.endpoints()] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    (tmp_path / "other").write_text("# comment\nhttp://127.0.0.1:3  # the third\n\n")
    (tmp_path / "other").replace(path)
    assert [e.url for e in discovery.endpoints()] == ["http://127.0.0.1:3"]
    with pytest.raises(ValueError, match="needs a file"):
        FileDiscovery("")


def routable_workers(router_url: str) -> set[str]:
    seen = HTTP.get(router_url + "/health", timeout=TIMEOUT_S).json().get("workers", {})
    return {url for url, state in seen.items() if state == "ok"}


def wait_for(condition, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def complete(router_url: str, model: str, max_tokens: int = 8) -> httpx.Response:
    return HTTP.post(router_url + "/v1/completions", timeout=TIMEOUT_S, json={
        "model": model, "prompt": list(range(5, 45)), "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def test_a_decode_worker_added_takes_requests_and_one_removed_drains_without_a_failure(tiny_v2):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=1, num_decode=1, scalable=True,
                        worker_args=("--dtype", "float32"), router_args=("--health-interval-s", "0.2"))
    with InProcessCluster(cfg) as cluster:
        model = HTTP.get(cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
        first_decode = cluster.workers[1]
        added = cluster.add_worker("decode")
        assert added.name == "decode-1"
        wait_for(lambda: added.url in routable_workers(cluster.url))

        # Only the new decode worker is left routable: every request's KV must reach it over the hand-off.
        results: list[int] = []
        streams = [threading.Thread(target=lambda: results.append(complete(cluster.url, model, 48).status_code))
                   for _ in range(3)]
        for stream in streams:
            stream.start()
        assert cluster.remove_worker(first_decode, drain_timeout_s=TIMEOUT_S)
        for stream in streams:
            stream.join(TIMEOUT_S)
        assert results == [200, 200, 200]  # what the removed worker ran, it finished
        assert not first_decode.alive and first_decode not in cluster.workers
        wait_for(lambda: first_decode.url not in routable_workers(cluster.url))

        before = metric_total(added.url, "pdserve_generation_tokens_total")
        assert all(complete(cluster.url, model).status_code == 200 for _ in range(3))
        # Each request's first token comes from the prefill worker, the other seven from the one decode worker left.
        assert metric_total(added.url, "pdserve_generation_tokens_total") >= before + 3 * 7


def test_a_fixed_cluster_refuses_to_change_its_pools(tiny_v2):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=1, num_decode=1, worker_args=("--dtype", "float32"))
    with InProcessCluster(cfg) as cluster, pytest.raises(ValueError, match="scalable"):
        cluster.add_worker("decode")
