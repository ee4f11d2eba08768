"""Graceful drain with real processes: SIGTERM on the worker serving a stream lets the stream finish, the router sends
new work elsewhere, and the worker exits within its grace period."""

import signal
import threading
import time

import pytest
from probes import HTTP, eventually
from stream_calls import TIMEOUT_S, model_of, running, stream_completion

from pdserve.cluster.local import ClusterConfig, LocalCluster

DRAIN_TIMEOUT_S = 40
LONG_TOKENS = 400


@pytest.fixture()
def cluster(tiny_v2, ray_address, tmp_path):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=0, num_decode=0, num_both=2, ray_address=ray_address,
                        worker_args=("--dtype", "float32", "--num-pages", "256", "--drain-timeout-s", str(DRAIN_TIMEOUT_S)),
                        log_dir=str(tmp_path))
    with LocalCluster(cfg) as local:
        yield local


def test_sigterm_drains_the_stream_routes_new_work_elsewhere_and_exits(cluster):
    model = model_of(cluster.url)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault(
        "long", stream_completion(cluster.url, model, "a long story about a fox", LONG_TOKENS)))
    thread.start()
    assert eventually(lambda: any(running(w.url) for w in cluster.workers), timeout_s=30)
    serving = next(w for w in cluster.workers if running(w.url))

    signalled_s = time.monotonic()
    serving.process.send_signal(signal.SIGTERM)
    health = HTTP.get(serving.url + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert eventually(lambda: HTTP.get(cluster.url + "/health", timeout=5).json()["workers"][serving.url] == "draining",
                      timeout_s=10)
    for i in range(3):  # new requests go to the other worker while the stream drains
        new = stream_completion(cluster.url, model, f"new request {i}", 8)
        assert new.finish_reason == "length" and len(new.token_ids) == 8 and not new.errors
    assert serving.process.poll() is None, "exited before its stream finished"

    thread.join(timeout=TIMEOUT_S)
    assert not thread.is_alive()
    long = result["long"]
    assert not long.errors and long.done and long.finish_reason == "length"
    assert len(long.token_ids) == LONG_TOKENS
    serving.process.wait(timeout=DRAIN_TIMEOUT_S)
    assert serving.process.returncode == 0
    assert time.monotonic() - signalled_s < DRAIN_TIMEOUT_S

