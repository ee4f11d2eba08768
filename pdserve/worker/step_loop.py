"""Steps one rank's engine on a thread of its own. Everything else reaches the engine by handing this thread a
closure (`call`), so the engine stays single-threaded; after each turn the thread publishes a `RankSnapshot`, from
which load, metrics and health are answered without waiting on it (a long step, a kernel compiling, is not death).
Given a step trace, it records each busy step's shape and turn time (pdserve/engine/step_trace.py)."""

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pdserve.engine.engine import Engine, RequestOutput
from pdserve.engine.stats import EngineStats
from pdserve.engine.lockstep import Lockstep
from pdserve.engine.step_shape import StepShape
from pdserve.engine.step_trace import StepTrace
from pdserve.worker.gc_pauses import GcClock
from pdserve.worker.step_speeds import StepSpeeds

log = logging.getLogger(__name__)
T = TypeVar("T")
SNAPSHOT_INTERVAL_S = 0.01  # engine figures are refreshed at most this often (reading them costs ~0.1 ms)
IDLE_WAIT_S = 0.005  # an idle expert-parallel rank waits this long for a closure before it turns again (its peers'
# steps need it in their collectives)
IDLE_BLOCK_S = 0.5  # any other idle loop sleeps until a closure comes (all new work does), turning at least this
# often so that its snapshot shows it alive; hundreds of ranks in one process must not wake 200 times a second
JOIN_TIMEOUT_S = 5.0


class InstanceBroken(RuntimeError):
    """An expert-parallel rank lost its peers (a collective failed); the instance must be re-formed."""


@dataclass(frozen=True)
class RankSnapshot:
    """What the step thread published after its last turn; any thread reads it without waiting on the step thread."""

    engine: EngineStats  # refreshed at most every SNAPSHOT_INTERVAL_S
    steps_completed: int
    turned_s: float  # monotonic time the loop last came around
    prefill_tokens_per_s: float = 0.0  # StepSpeeds'
    decode_step_s: float = 0.0  # StepSpeeds'


@dataclass(frozen=True)
class _OpenTurn:
    """A traced step whose turn of the loop has not ended yet."""

    shape: StepShape
    started_s: float
    engine_ms: float
    gc_s: float  # the garbage collector's clock when the turn started
    wait_ms: float  # of engine_ms, waiting for the device
    free_pages: int  # after the step (a decode rank short of pages shows here)
    held_seqs: int


class StepLoop:
    def __init__(self, engine: Engine, rank: int, lockstep: Lockstep | None,
                 route: Callable[[list[RequestOutput]], None], fail_all: Callable[[str], None]):
        """`route` gets each step's outputs at once, `fail_all` a message when a step raised; both on the step
        thread."""
        self.engine = engine
        self.test_step_delay_s = 0.0  # test hook: each step first sleeps this long (a slow kernel)
        self.trace: StepTrace | None = None  # set by trace_to
        self._gc: GcClock | None = None
        self._open_turn: _OpenTurn | None = None
        self._rank = rank
        self._lockstep = lockstep
        self._idle_wait_s = IDLE_WAIT_S if lockstep is not None else IDLE_BLOCK_S
        self._route = route
        self._fail_all = fail_all
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._broken: str | None = None
        self._steps_completed = 0
        self._speeds = StepSpeeds()
        self._stats_published_s = time.monotonic()
        self.snapshot = RankSnapshot(engine.stats(), 0, self._stats_published_s)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"rank-{self._rank}-step", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put((lambda: None, concurrent.futures.Future()))  # wakes an idle loop to see it
        if self._thread is not None:
            self._thread.join(timeout=JOIN_TIMEOUT_S)

    def trace_to(self, trace: StepTrace) -> None:
        """From now on trace each busy step's turn, and the time collecting garbage in it (closed when the loop
        ends)."""
        self.trace, self._gc = trace, GcClock()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the step thread, between steps."""
        if self._broken is not None:
            raise InstanceBroken(self._broken)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        if self._broken is not None:  # broke while we queued: fail what the step thread will never run
            self._break(self._broken)
        return await asyncio.wrap_future(future)

    # --- the step thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                idle = not self.engine.has_work()
                if idle:
                    self._went_idle()
                self._run_commands(block=idle)
                try:
                    outputs = self._step()
                    # Published before the outputs leave: a caller that has its last token, then reads the rank's
                    # figures (a metrics scrape), finds that token counted.
                    self._turned()
                    if outputs:
                        self._route(outputs)
                except Exception:  # noqa: BLE001 - a step failure must reach every caller, not kill the thread
                    log.exception("rank %s step failed", self._rank)
                    self._fail_all("engine step failed")
                    if self._lockstep is not None:  # a peer is gone: no later collective can succeed
                        self._break(f"rank {self._rank} lost its expert-parallel peers")
                        return
                    self._turned()
        finally:
            if self.trace is not None:
                self.trace.close()
            if self._gc is not None:
                self._gc.close()

    def _step(self) -> list[RequestOutput]:
        busy = self.engine.has_work()
        if self._lockstep is not None:
            busy = self._lockstep.any_rank_busy(busy)
        if not busy:
            return []
        started_s = time.monotonic()
        self._end_turn(started_s)
        self._speeds.turn_ended(started_s)
        gc_s = self._gc.seconds if self._gc is not None else 0.0
        if self.test_step_delay_s:
            time.sleep(self.test_step_delay_s)
        engine_started_s = time.monotonic()
        outputs = self.engine.step(force_forward=self._lockstep is not None)
        self._steps_completed += 1
        self._speeds.turn_started(started_s, self.engine.last_step)
        if self.trace is not None and self.engine.last_step.ran_work:
            engine_ms = (time.monotonic() - engine_started_s) * 1000
            engine = self.engine
            self._open_turn = _OpenTurn(engine.last_step, started_s, engine_ms, gc_s, engine.last_step_wait_s * 1000,
                                        engine.available_pages, len(engine.requests))
        return outputs

    def _end_turn(self, now_s: float) -> None:
        """The traced step's turn ends: at the next step's start, or where the loop found no more work."""
        turn, self._open_turn = self._open_turn, None
        if turn is not None and self.trace is not None:
            gc_ms = (self._gc.seconds - turn.gc_s) * 1000 if self._gc is not None else 0.0
            self.trace.record(turn.shape, turn.started_s, turn.engine_ms, now_s, gc_ms, turn.wait_ms, turn.free_pages,
                              turn.held_seqs)

    def _went_idle(self) -> None:
        """The wait for work that follows is no step's cost; what the trace holds is written before it, and the
        snapshot gets the speeds of the turn that just ended (the loop may sleep until a command comes)."""
        now = time.monotonic()
        self._speeds.turn_ended(now)
        self.snapshot = replace(self.snapshot, prefill_tokens_per_s=self._speeds.prefill_tokens_per_s,
                                decode_step_s=self._speeds.decode_step_s)
        if self.trace is not None:
            self._end_turn(now)
            self.trace.flush()

    def _turned(self) -> None:
        now = time.monotonic()
        stats = self.snapshot.engine
        # About to idle (and perhaps sleep until a closure comes): publish what the last steps did now.
        if now - self._stats_published_s >= SNAPSHOT_INTERVAL_S or not self.engine.has_work():
            stats, self._stats_published_s = self.engine.stats(), now
        speeds = self._speeds
        self.snapshot = RankSnapshot(stats, self._steps_completed, now, speeds.prefill_tokens_per_s, speeds.decode_step_s)

    def _break(self, message: str) -> None:
        """Stop taking work and fail whatever is queued, so no caller waits on a step thread that has ended."""
        self._broken = message
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(InstanceBroken(message))

    def _run_commands(self, block: bool) -> None:
        """The closures queued by now; those queued meanwhile wait for the next turn. Drained until empty, closures
        queued faster than they run (hundreds of reservations retrying every 20 ms) held the loop with no step: the
        likely cause of a decode rank's 51 s stall on two H100s (docs/benchmarks.md)."""
        try:
            taken = [self._commands.get(timeout=self._idle_wait_s if block else 0)]
        except queue.Empty:
            return
        for _ in range(self._commands.qsize()):
            taken.append(self._commands.get_nowait())  # this thread alone takes from the queue: none is missing
        for fn, future in taken:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as error:  # noqa: BLE001 - handed to the awaiting caller
                    future.set_exception(error)
