"""A prefill worker killed (SIGKILL) beside another, with one decode worker: until the router's health checks eject
it (seconds), requests it sends there fail in the hand-off, which the decode worker reports as the prefill side's;
the router retries them on the same decode rank with the other prefill worker, and the client sees nothing."""

from probes import HTTP, metric_total
from stream_calls import TIMEOUT_S, model_of

from pdserve.cluster.local import ClusterConfig, LocalCluster


def test_requests_sent_to_a_dead_prefill_worker_are_served_through_the_other(tiny_v2, ray_address, tmp_path):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=2, num_decode=1, ray_address=ray_address,
                        worker_args=("--dtype", "float32"), log_dir=str(tmp_path / "logs"))
    with LocalCluster(cfg) as cluster:
        model = model_of(cluster.url)
        cluster.kill(cluster.workers[0])  # prefill-0
        # Right after the kill the router still routes to it: idle prefill ranks take turns.
        replies = [HTTP.post(cluster.url + "/v1/completions", timeout=TIMEOUT_S, json={
            "model": model, "prompt": list(range(5 + i, 45 + i)), "max_tokens": 4, "temperature": 0})
            for i in range(4)]
        assert [reply.status_code for reply in replies] == [200] * 4, [reply.text for reply in replies]
        assert metric_total(cluster.url, "pdserve_router_retries_total") >= 1  # some went to the dead one first
