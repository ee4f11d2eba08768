import asyncio
import gc
import time

from pdserve.bench.loop_watch import LoopWatch


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what a blocking call on the event loop does to every stream the client reads


def test_a_held_loop_is_reported_with_its_length_and_the_stack_that_held_it():
    async def run() -> LoopWatch:
        async with LoopWatch(threshold_s=0.05) as watch:
            await asyncio.sleep(0.05)
            _hold_the_loop(0.2)
            await asyncio.sleep(0.05)
        return watch

    watch = asyncio.run(asyncio.wait_for(run(), timeout=10))
    assert len(watch.stalls) == 1, watch.stalls
    stall = watch.stalls[0]
    assert 0.15 <= stall.duration_s < 0.5
    assert 0.03 <= stall.start_s < 0.2
    assert "_hold_the_loop" in stall.stack


def test_a_loop_that_keeps_turning_has_no_stalls():
    async def run() -> LoopWatch:
        async with LoopWatch(threshold_s=0.05) as watch:
            for _ in range(20):
                await asyncio.sleep(0.01)
        return watch

    assert asyncio.run(asyncio.wait_for(run(), timeout=10)).stalls == []


def test_a_stall_of_the_garbage_collector_is_told_apart():
    async def run() -> LoopWatch:
        async with LoopWatch(threshold_s=0.02) as watch:
            await asyncio.sleep(0.02)
            cycles = []
            for _ in range(200_000):  # enough tracked objects for a full collection to take a while
                node = [None]
                node[0] = node
                cycles.append(node)
            del cycles
            started = time.perf_counter()
            while time.perf_counter() - started < 0.05:  # collect until the loop has been held past the threshold
                gc.collect()
            await asyncio.sleep(0.02)
        return watch

    stalls = asyncio.run(asyncio.wait_for(run(), timeout=20)).stalls
    assert stalls, "the loop was held over 50 ms"
    assert max(stall.gc_s for stall in stalls) > 0.02, stalls
