"""The step thread of a rank (real engine, tiny model): its snapshot answers at once while a step is slow, shows the
loop stalled for as long as the step lasts and counts completed steps; closures run on the step thread."""

import asyncio
import concurrent.futures
import threading
import time

import pytest
from probes import eventually

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.wire.sampling import SamplingParams
from pdserve.worker import step_loop
from pdserve.worker.step_loop import StepLoop


@pytest.fixture
def loop_and_outputs(tiny_v2):
    outputs = []
    steps = StepLoop(Engine(EngineConfig(model=tiny_v2, dtype="float32", num_pages=32, progress=False)), 0, None,
                     outputs.extend, lambda message: None)
    steps.start()
    yield steps, outputs
    steps.stop()


def test_the_snapshot_answers_during_a_slow_step_and_counts_steps(loop_and_outputs):
    steps, outputs = loop_and_outputs
    steps.test_step_delay_s = 1.5
    before = steps.snapshot.steps_completed
    asyncio.run(steps.call(lambda: steps.engine.add_request("slow", [3, 4, 5], SamplingParams(max_tokens=1))))
    assert eventually(lambda: time.monotonic() - steps.snapshot.turned_s > 0.5, timeout_s=5, interval_s=0.01)
    started = time.monotonic()
    snapshot = steps.snapshot  # read from another thread while the step sleeps
    assert time.monotonic() - started < 0.1 and snapshot.steps_completed == before
    assert eventually(lambda: outputs and outputs[-1].finish_reason == "length", timeout_s=10)
    assert eventually(lambda: steps.snapshot.steps_completed == before + 1 and
                      time.monotonic() - steps.snapshot.turned_s < 0.5, timeout_s=5)
    assert eventually(lambda: steps.snapshot.engine.running == 0 and steps.snapshot.engine.waiting == 0, timeout_s=5)


def test_closures_run_on_the_step_thread(loop_and_outputs):
    steps, _ = loop_and_outputs
    assert asyncio.run(steps.call(lambda: threading.current_thread().name)) == "rank-0-step"


def test_closures_queued_faster_than_they_run_leave_the_steps_going(loop_and_outputs):
    """A closure that queues another as it runs (as reservations retrying faster than the loop serves them do) is
    always waiting: the loop still steps between its turns' closures and finishes the running request."""
    steps, outputs = loop_and_outputs
    flooding = threading.Event()
    flooding.set()

    def again() -> None:
        time.sleep(0.001)
        if flooding.is_set():
            steps._commands.put((again, concurrent.futures.Future()))

    asyncio.run(steps.call(lambda: steps.engine.add_request("r", [3, 4, 5], SamplingParams(max_tokens=20))))
    steps._commands.put((again, concurrent.futures.Future()))
    try:
        assert eventually(lambda: outputs and outputs[-1].finish_reason == "length", timeout_s=10)
    finally:
        flooding.clear()


def test_a_finished_request_is_counted_before_its_last_token_leaves(tiny_v2, monkeypatch):
    """A caller that has its last token, then reads the rank's figures (a metrics scrape), finds that token counted:
    the snapshot is published before a step's outputs are handed on (a scaling test once read it a step stale)."""
    monkeypatch.setattr(step_loop, "SNAPSHOT_INTERVAL_S", 3600.0)  # published at most once, and when work runs out
    counted_when_done: list[int] = []

    def route(outputs) -> None:
        if any(output.finish_reason for output in outputs):
            counted_when_done.append(steps.snapshot.engine.generation_tokens)

    steps = StepLoop(Engine(EngineConfig(model=tiny_v2, dtype="float32", num_pages=32, progress=False)), 0, None,
                     route, lambda message: None)
    steps.start()
    try:
        sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        asyncio.run(steps.call(lambda: steps.engine.add_request("r", [3, 4, 5], sampling)))
        assert eventually(lambda: counted_when_done, timeout_s=10)
        assert counted_when_done == [6]
    finally:
        steps.stop()
