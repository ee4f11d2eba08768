"""Ejection against a real worker that stops answering (SIGSTOP: alive, unresponsive) rather than dying: its health
checks time out, so the router keeps it for `--eject-unresponsive-after-s` before ejecting it, and re-admits it when
it answers again."""

import os
import signal

import pytest

from pdserve.cluster.local import ClusterConfig, LocalCluster

from probes import HTTP, eventually, metric_total

UNRESPONSIVE_AFTER_S = 6.0
TIMEOUT_S = 30.0


def ejections(router_url: str) -> float:
    return metric_total(router_url, "pdserve_router_worker_ejections_total")


@pytest.mark.timeout(180)
def test_an_unresponsive_worker_is_ejected_only_after_the_grace_period_and_readmitted(tiny_v2, ray_address, tmp_path):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=0, num_decode=0, num_both=1, ray_address=ray_address,
                        worker_args=("--dtype", "float32", "--num-pages", "64"),
                        router_args=("--eject-unresponsive-after-s", str(UNRESPONSIVE_AFTER_S)), log_dir=str(tmp_path))
    with LocalCluster(cfg) as cluster:
        worker = cluster.workers[0]
        os.killpg(worker.process.pid, signal.SIGSTOP)
        try:
            # Two failed checks (about 2-3 s) would eject a worker that refuses connections; this one only times out.
            assert not eventually(lambda: ejections(cluster.url) >= 1, UNRESPONSIVE_AFTER_S - 1.5, interval_s=0.2)
            assert eventually(lambda: ejections(cluster.url) >= 1, 10.0, interval_s=0.2)
        finally:
            os.killpg(worker.process.pid, signal.SIGCONT)
        model = HTTP.get(cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]

        def serves() -> bool:
            response = HTTP.post(cluster.url + "/v1/completions", timeout=TIMEOUT_S,
                                  json={"model": model, "prompt": "hello", "max_tokens": 2})
            return response.status_code == 200

        assert eventually(serves, 15.0, interval_s=0.2)
