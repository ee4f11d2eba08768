"""The load generator's own stalls. A client whose event loop is held up reads every stream late, and the gaps it then
records are its own, not the server's: a heartbeat task notes each beat that came later than a threshold, and a
watchdog thread takes the loop thread's stack while it is held, so a report can say what held it. The garbage
collector holds the GIL without a Python frame to show, so the time it ran within each stall is kept apart."""

import asyncio
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from pdserve.worker.gc_pauses import GcClock

STACK_FRAMES = 8  # innermost frames kept per stall


@dataclass(frozen=True)
class LoopStall:
    start_s: float  # from the watch's start
    duration_s: float
    stack: str  # the loop thread's innermost frames while held; '' when the watchdog could not run meanwhile (the
    # GIL held throughout by C code, or the whole process descheduled)
    gc_s: float  # of the stall, the time the garbage collector ran


class LoopWatch:
    """Use as `async with LoopWatch() as watch:` around the work; `watch.stalls` once it has ended."""

    def __init__(self, threshold_s: float = 0.05, beat_s: float = 0.005):
        self.threshold_s, self.beat_s = threshold_s, beat_s
        self.stalls: list[LoopStall] = []
        self._beats = 0
        self._last_beat_s = 0.0
        self._stacks: dict[int, str] = {}  # beat number -> stack taken while the loop was held after that beat
        self._stop = threading.Event()
        self._gc_at_last_beat_s = 0.0

    async def __aenter__(self) -> "LoopWatch":
        self._gc = GcClock()
        self._started_s = self._last_beat_s = time.perf_counter()
        self._loop_thread = threading.get_ident()
        self._beater = asyncio.create_task(self._beat())
        self._watchdog = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._watchdog.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self._gc.close()
        self._stop.set()
        self._beater.cancel()
        await asyncio.gather(self._beater, return_exceptions=True)
        self._watchdog.join(timeout=1.0)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.beat_s)
            now = time.perf_counter()
            late = now - self._last_beat_s - self.beat_s
            if late > self.threshold_s:
                self.stalls.append(LoopStall(self._last_beat_s - self._started_s, late,
                                             self._stacks.get(self._beats, ""),
                                             self._gc.seconds - self._gc_at_last_beat_s))
            self._stacks.clear()
            self._beats += 1
            self._last_beat_s, self._gc_at_last_beat_s = now, self._gc.seconds

    def _watch(self) -> None:
        while not self._stop.wait(self.threshold_s / 2):
            beat = self._beats
            if beat in self._stacks or time.perf_counter() - self._last_beat_s < self.threshold_s + self.beat_s:
                continue
            frame = sys._current_frames().get(self._loop_thread)
            if frame is not None:
                self._stacks[beat] = "".join(traceback.format_stack(frame)[-STACK_FRAMES:])
