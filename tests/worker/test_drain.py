"""DrainGate: when a draining worker may exit (nothing in flight, or the grace period is over), and what the worker
edge counts in flight."""

import asyncio
import time

import httpx
from probes import Listener

from pdserve.engine.config import EngineConfig
from pdserve.http.internal_auth import bearer_headers
from pdserve.transfer.inprocess import InjectedFaults, InProcessBackend, InProcessFabric
from pdserve.worker.config import WorkerConfig
from pdserve.worker.drain import DrainGate
from pdserve.worker.http_app import RankSet, build_worker_app
from pdserve.worker.inprocess_rank import InProcessRank
from pdserve.worker.process import describe_worker, handoff_guard, rank_configs
from pdserve.worker.rank_runtime import RankRuntime


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_a_worker_that_is_not_draining_never_counts_as_drained() -> None:
    gate = DrainGate(FakeClock())
    assert not gate.draining and not gate.drained(timeout_s=0.0)


def test_draining_ends_when_the_last_request_finishes() -> None:
    gate = DrainGate(FakeClock())
    gate.in_flight = 2
    gate.start_draining()
    assert gate.draining and not gate.drained(timeout_s=30.0)
    gate.in_flight = 0
    assert gate.drained(timeout_s=30.0)


def test_draining_ends_at_the_timeout_even_with_requests_in_flight() -> None:
    clock = FakeClock()
    gate = DrainGate(clock)
    gate.in_flight = 1
    gate.start_draining()
    clock.now_s += 29.9
    assert not gate.drained(timeout_s=30.0)
    clock.now_s += 0.2
    assert gate.drained(timeout_s=30.0)


def test_a_second_signal_does_not_restart_the_grace_period() -> None:
    clock = FakeClock()
    gate = DrainGate(clock)
    gate.in_flight = 1
    gate.start_draining()
    clock.now_s += 20
    gate.start_draining()
    clock.now_s += 11
    assert gate.drained(timeout_s=30.0)


def test_a_prefill_counts_as_in_flight_while_its_reservation_is_being_confirmed(tiny_v2) -> None:
    """The rank computes from the moment the worker edge has a prefill plan, before the edge's response exists (the
    confirm may wait as long as the decode rank waits for room): a drain must wait for it. The decode worker here
    takes the confirm's connection and never answers."""
    silent, token = Listener(hold=True), "t" * 43
    cfg = WorkerConfig(EngineConfig(model=tiny_v2, dtype="float32", num_pages=64, progress=False), role="prefill",
                       peers=(silent.url,), prefill_timeout_s=0.5, internal_token=token, warmup=False)
    body = {"request_id": "r1", "rank": 0, "prompt_token_ids": list(range(3, 40)), "sampling": {"max_tokens": 1},
            "plan": {"kind": "prefill", "destination": {"url": silent.url, "rank": 0, "reservation_token": "x"}}}

    async def scenario() -> tuple[bool, int, int]:
        fabric = InProcessFabric()
        runtime = RankRuntime(rank_configs(cfg)[0],
                              lambda name, kv, notify: InProcessBackend(name, kv, notify, fabric, InjectedFaults()))
        rank, gate = InProcessRank(runtime), DrainGate()
        info, ready_s = await describe_worker(cfg, [rank], time.monotonic())
        app = build_worker_app(cfg, RankSet([rank]), info, handoff_guard(cfg), gate, ready_s)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
                posting = asyncio.ensure_future(client.post("/internal/v1/generate", json=body,
                                                            headers=bearer_headers(token), timeout=30))
                counted = False
                for _ in range(200):  # while the confirm waits: the rank holds the request, the gate counts it
                    if runtime.sender.holds("r1"):
                        counted = gate.in_flight == 1
                        break
                    await asyncio.sleep(0.01)
                response = await posting
        finally:
            runtime.stop()
            silent.close()
        return counted, response.status_code, gate.in_flight

    counted, status, left = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert counted and status == 502 and left == 0
