"""The whole loop on a cluster of simulated workers: the planner reads the real router's metrics, grows the prefill
pool under load and shrinks it after the load is gone, and no request fails while workers come and go."""

import threading
import time

import httpx
from probes import HTTP

from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig
from pdserve.engine.step_profile import DEFAULT_PROFILE, StepProfile
from pdserve.planner.config import PlannerConfig
from pdserve.planner.loop import router_urls_now, run_planner
from pdserve.planner.policy import Planner, PoolSizes
from pdserve.planner.pools import ClusterPools

TIMEOUT_S = 60.0


def wait_for(condition, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def test_the_planner_grows_the_prefill_pool_under_load_and_shrinks_it_after(tiny_v2):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=1, num_decode=1, scalable=True,
                        worker_args=("--engine", "simulated", "--page-size", "16", "--no-warmup"),
                        router_args=("--health-interval-s", "0.2"))
    # A prefill rank planned at 0.5% of its profiled throughput: a few requests a second need more than one.
    planner_cfg = PlannerConfig(interval_s=0.5, lookahead_s=0, scale_down_window_s=2.0, prefill_utilization=0.005,
                                max_prefill=2, max_decode=1)
    with InProcessCluster(cfg, transfer="inprocess") as cluster:
        model = HTTP.get(cluster.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
        pools = ClusterPools(cluster, drain_timeout_s=TIMEOUT_S)
        stop_planner, stop_load = threading.Event(), threading.Event()
        decisions = []
        planner = threading.Thread(target=run_planner, daemon=True, args=(
            Planner(planner_cfg, StepProfile.load(DEFAULT_PROFILE)), pools, router_urls_now(lambda: [cluster.url]),
            stop_planner, lambda decision, traffic, current: decisions.append(decision)))
        statuses: list[int] = []

        def load() -> None:
            with httpx.Client(timeout=TIMEOUT_S) as http:
                while not stop_load.is_set():
                    statuses.append(http.post(cluster.url + "/v1/completions", json={
                        "model": model, "prompt": list(range(5, 205)), "max_tokens": 4, "ignore_eos": True,
                        "temperature": 0}).status_code)

        senders = [threading.Thread(target=load, daemon=True) for _ in range(2)]
        try:
            planner.start()
            for sender in senders:
                sender.start()
            wait_for(lambda: pools.sizes() == PoolSizes(2, 1) and len(cluster.workers) == 3)
            grown_after = len(statuses)
            wait_for(lambda: len(statuses) >= grown_after + 10)  # the grown pool serves
            stop_load.set()
            for sender in senders:
                sender.join(TIMEOUT_S)
            wait_for(lambda: pools.sizes() == PoolSizes(1, 1) and len(cluster.workers) == 2)
        finally:
            stop_load.set()
            stop_planner.set()
            planner.join(TIMEOUT_S)
            pools.close()
        assert statuses and set(statuses) == {200}
        assert any(d.target.prefill == 2 for d in decisions) and decisions[-1].target == PoolSizes(1, 1)
