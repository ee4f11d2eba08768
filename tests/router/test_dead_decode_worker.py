"""A decode worker that died but is not yet ejected (the router's health checks take seconds to notice): a request the
router sends there is refused, and is retried on the other decode worker with the same prefill worker, the only one
there is. An in-process cluster, one decode worker's server stopped as a killed process's would be."""

import asyncio

from probes import HTTP, metric_total

from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig

TIMEOUT_S = 60.0


def test_a_request_refused_by_a_dead_decode_worker_is_retried_with_the_same_prefill_worker(tiny_v2):
    # Health checks an hour apart: the stopped worker stays routable for the whole test, as in the seconds after a
    # kill.
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=1, num_decode=2, worker_args=("--dtype", "float32"),
                        router_args=("--health-interval-s", "3600"))
    with InProcessCluster(cfg) as cluster:
        model = HTTP.get(cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
        dead = cluster.workers[1]

        async def stop() -> None:
            dead.server.should_exit = True
            assert dead.task is not None
            await dead.task

        cluster.run(stop(), TIMEOUT_S)
        # Idle decode ranks take turns, so one of two requests in a row goes to the stopped worker.
        statuses = [HTTP.post(cluster.url + "/v1/completions", timeout=TIMEOUT_S, json={
            "model": model, "prompt": list(range(5, 45)), "max_tokens": 4, "temperature": 0}).status_code
            for _ in range(2)]
        assert statuses == [200, 200]
        assert metric_total(cluster.url, "pdserve_router_retries_total") == 1
