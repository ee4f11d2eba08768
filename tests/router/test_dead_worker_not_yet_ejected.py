"""A worker that died but is not yet ejected (the router's health checks take seconds to notice). In-process clusters,
one worker's server stopped as a killed process's would be, health checks an hour apart so the stopped worker stays
routable for the whole test:
- a dead decode worker refuses the request: the router retries it on the other decode worker with the same prefill
  worker, the only one there is;
- a dead prefill worker fails the decode rank's hand-off, which names the prefill side: the router retries on the same
  decode worker, the only one, with the other prefill worker;
- with no other prefill worker, the decode worker prefills the retry itself (the router's prefill fallback), and the
  answer is the one the pair gave before."""

import pytest
from probes import HTTP, metric_total

from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig

TIMEOUT_S = 60.0


def completion(cluster: InProcessCluster, model: str, first: int):
    return HTTP.post(cluster.url + "/v1/completions", timeout=TIMEOUT_S, json={
        "model": model, "prompt": list(range(first, first + 40)), "max_tokens": 4, "temperature": 0})


def model_of(cluster: InProcessCluster) -> str:
    return HTTP.get(cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]


def cluster_config(tiny_v2, num_prefill: int, num_decode: int, *router_args: str) -> ClusterConfig:
    return ClusterConfig(model=tiny_v2, port=0, num_prefill=num_prefill, num_decode=num_decode,
                         worker_args=("--dtype", "float32"), router_args=("--health-interval-s", "3600", *router_args))


@pytest.mark.parametrize("pools, dead", [((1, 2), 1), ((2, 1), 0)], ids=["decode", "prefill"])
def test_a_request_sent_to_a_dead_worker_is_retried_with_the_live_one_of_its_pair(tiny_v2, pools, dead):
    with InProcessCluster(cluster_config(tiny_v2, *pools)) as cluster:
        model = model_of(cluster)
        cluster.kill(cluster.workers[dead])  # a prefill worker's KV-event stream to the router is cut
        # Idle ranks take turns, so one of two requests in a row (at least) goes to the stopped worker.
        replies = [completion(cluster, model, 5 + i) for i in range(2)]
        assert [reply.status_code for reply in replies] == [200, 200], [reply.text for reply in replies]
        assert metric_total(cluster.url, "pdserve_router_retries_total") >= 1  # one or both went there first
        assert metric_total(cluster.url, "pdserve_router_prefill_fallbacks_total") == 0


def test_the_decode_worker_prefills_itself_when_the_only_prefill_worker_is_dead(tiny_v2):
    with InProcessCluster(cluster_config(tiny_v2, 1, 1)) as cluster:
        model = model_of(cluster)
        before = completion(cluster, model, 5).json()["choices"][0]["text"]
        cluster.kill(cluster.workers[0])
        replies = [completion(cluster, model, 5) for _ in range(2)]
        assert [reply.status_code for reply in replies] == [200, 200], [reply.text for reply in replies]
        assert [reply.json()["choices"][0]["text"] for reply in replies] == [before] * 2
        assert metric_total(cluster.url, "pdserve_router_prefill_fallbacks_total") == 2
        assert metric_total(cluster.url, "pdserve_router_retries_total") == 2  # each went to the dead one first


def test_without_the_fallback_a_dead_only_prefill_worker_fails_the_request(tiny_v2):
    with InProcessCluster(cluster_config(tiny_v2, 1, 1, "--no-prefill-fallback")) as cluster:
        model = model_of(cluster)
        cluster.kill(cluster.workers[0])
        reply = completion(cluster, model, 5)
        assert reply.status_code == 502, reply.text
        assert "prefill" in reply.json()["error"]["message"]
