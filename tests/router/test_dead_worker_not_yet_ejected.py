"""A worker that died but is not yet ejected (the router's health checks take seconds to notice). In-process clusters,
one worker's server stopped as a killed process's would be, health checks an hour apart so the stopped worker stays
routable for the whole test:
- a dead decode worker refuses the request: the router retries it on the other decode worker with the same prefill
  worker, the only one there is;
- a dead prefill worker fails the decode rank's hand-off, which names the prefill side: the router retries on the same
  decode worker, the only one, with the other prefill worker."""

import asyncio

import pytest
from probes import HTTP, metric_total

from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig

TIMEOUT_S = 60.0


@pytest.mark.parametrize("pools, dead", [((1, 2), 1), ((2, 1), 0)], ids=["decode", "prefill"])
def test_a_request_sent_to_a_dead_worker_is_retried_with_the_live_one_of_its_pair(tiny_v2, pools, dead):
    num_prefill, num_decode = pools
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=num_prefill, num_decode=num_decode,
                        worker_args=("--dtype", "float32"), router_args=("--health-interval-s", "3600"))
    with InProcessCluster(cfg) as cluster:
        model = HTTP.get(cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
        stopped = cluster.workers[dead]

        async def stop() -> None:
            # A prefill worker's KV-event stream to the router never ends by itself: the stop cuts it.
            stopped.server.should_exit = True
            assert stopped.task is not None
            await stopped.task

        cluster.run(stop(), TIMEOUT_S)
        # Idle ranks take turns, so one of two requests in a row goes to the stopped worker.
        replies = [HTTP.post(cluster.url + "/v1/completions", timeout=TIMEOUT_S, json={
            "model": model, "prompt": list(range(5 + i, 45 + i)), "max_tokens": 4, "temperature": 0})
            for i in range(2)]
        assert [reply.status_code for reply in replies] == [200, 200], [reply.text for reply in replies]
        assert metric_total(cluster.url, "pdserve_router_retries_total") == 1
