"""Health never waits on the step thread: a long step (a kernel compiling) keeps /health at 200 and the router keeps
the worker, a stuck one (the step loop not moving for --stuck-step-timeout-s) is unhealthy, a restarted rank is not
ready until it has warmed up; and a worker reports its start time and warm-up."""

import asyncio
import threading
import time

import pytest
from probes import HTTP, health_status, internal_headers, metric_total

from pdserve.cluster.local import ClusterConfig, LocalCluster
from pdserve.wire.protocol import RankLoad
from pdserve.worker.http_app import RankSet, rank_condition

STEP_DELAY_S = 8.0  # longer than the 5 s the old health check waited on the step thread, and than router ejection


def load(stalled_s: float = 0.0, warming_up: bool = False) -> RankLoad:
    return RankLoad(0, 0, 0, 10, 10, 0, 5, stalled_s, warming_up)


@pytest.mark.parametrize("rank_load, condition", [
    (load(), "ok"),
    (load(stalled_s=250.0), "ok"),  # a long step, below the bound: alive
    (load(stalled_s=301.0), "stuck"),
    (load(warming_up=True), "warming_up"),
    (None, "down"),
])
def test_rank_condition(rank_load, condition):
    assert rank_condition(rank_load, stuck_after_s=300.0) == condition


class StubRank:
    """Answers load like a rank actor (or does not answer: `answer` None)."""

    def __init__(self, rank: int, answer: RankLoad | None):
        self.rank, self.answer = rank, answer

    async def load(self, timeout_s: float) -> RankLoad:
        if self.answer is None:
            raise TimeoutError("no answer")
        return self.answer


@pytest.mark.parametrize("answer, restarts", [(load(warming_up=True), 0), (load(stalled_s=999.0), 1), (None, 1)])
def test_an_instance_restarts_for_a_stuck_or_dead_rank_never_for_one_warming_up(answer, restarts):
    restarted: list[int] = []

    async def restart():
        restarted.append(1)
        return [StubRank(0, load()), StubRank(1, load())]

    ranks = RankSet([StubRank(0, load()), StubRank(1, answer)], restart=restart, stuck_after_s=300.0)  # type: ignore[list-item]

    async def two_rounds():
        watcher = asyncio.ensure_future(ranks.watch())
        await asyncio.sleep(1.5)
        watcher.cancel()

    asyncio.run(two_rounds())
    assert len(restarted) == restarts
    assert ranks.status == ("unhealthy" if answer is not None and answer.warming_up else "ok")


@pytest.fixture(scope="module")
def slow_cluster(tiny_v2, ray_address, tmp_path_factory):
    """A router and one colocated worker whose every step (after warm-up) takes STEP_DELAY_S."""
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=0, num_decode=0, num_both=1, ray_address=ray_address,
                        worker_args=("--dtype", "float32", "--num-pages", "128", "--test-step-delay-s", str(STEP_DELAY_S)),
                        log_dir=str(tmp_path_factory.mktemp("slow-cluster")))
    with LocalCluster(cfg) as cluster:
        yield cluster


def test_a_long_step_keeps_the_worker_healthy_and_routed(slow_cluster, tiny_v2):
    worker = slow_cluster.workers[0]
    model = HTTP.get(slow_cluster.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    result: dict = {}

    def complete() -> None:
        result["response"] = HTTP.post(slow_cluster.url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": "a slow step", "max_tokens": 1})

    request = threading.Thread(target=complete)
    request.start()
    statuses, router_views, stalls = [], [], []
    deadline = time.monotonic() + STEP_DELAY_S + 2.0
    while time.monotonic() < deadline and request.is_alive():
        statuses.append(health_status(worker.url))
        router_views.append(HTTP.get(slow_cluster.url + "/health", timeout=2).json()["workers"].get(worker.url))
        started = time.monotonic()
        ranks = HTTP.get(worker.url + "/internal/v1/load", headers=internal_headers(), timeout=2).json()["ranks"]
        assert time.monotonic() - started < 2.0 and len(ranks) == 1  # answered while the step runs
        stalls.append(ranks[0]["loop_stalled_s"])
        time.sleep(0.25)
    request.join(timeout=60)
    assert max(stalls) > 5.0, stalls  # the step really was long
    assert set(statuses) == {200}, statuses
    assert set(router_views) == {"ok"}, router_views
    response = result["response"]
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1


def test_a_worker_reports_its_start_and_warm_up(slow_cluster):
    worker = slow_cluster.workers[0]
    assert metric_total(worker.url, "pdserve_worker_start_seconds") > 0
    info = HTTP.get(worker.url + "/internal/v1/info", headers=internal_headers(), timeout=10).json()
    assert all(rank["warmup_s"] > 0 for rank in info["ranks"])  # it warmed up before it reported ready


@pytest.mark.slow
def test_a_stuck_step_makes_the_worker_unhealthy_until_it_moves_again(tiny_v2, ray_address, tmp_path):
    cfg = ClusterConfig(model=tiny_v2, port=0, num_prefill=0, num_decode=0, num_both=1, ray_address=ray_address,
                        worker_args=("--dtype", "float32", "--num-pages", "128", "--test-step-delay-s", "6",
                                     "--stuck-step-timeout-s", "2"), log_dir=str(tmp_path))
    with LocalCluster(cfg) as cluster:
        worker = cluster.workers[0]
        body = {"request_id": "stuck", "rank": 0, "prompt_token_ids": [5, 6, 7], "sampling": {"max_tokens": 1}}
        request = threading.Thread(target=lambda: HTTP.post(worker.url + "/internal/v1/generate", json=body,
                                                             headers=internal_headers(), timeout=60))
        request.start()
        statuses = []
        while request.is_alive():
            statuses.append(health_status(worker.url))
            time.sleep(0.25)
        assert 503 in statuses
        deadline = time.monotonic() + 10
        while health_status(worker.url) != 200 and time.monotonic() < deadline:
            time.sleep(0.25)
        assert health_status(worker.url) == 200
