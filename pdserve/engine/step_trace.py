"""A rank's step trace: one JSON line per step that ran work, holding the step's shape and the wall time of the step
loop's whole turn around it (the engine step, routing its outputs, the calls run before the next step). That turn is
what a step costs in service; profile_fit.py turns a trace into a step profile for the simulated engine.

Lines are kept in memory and appended to the file whole, at most every FLUSH_INTERVAL_S while busy and whenever the
loop goes idle, so a reader sees a trace at most that old and never half a line."""

import gzip
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from pdserve.engine.step_shape import StepShape

FLUSH_INTERVAL_S = 1.0


@dataclass(frozen=True)
class StepRecord:
    t_s: float  # when the step started, seconds after the trace was opened
    shape: StepShape
    engine_ms: float  # the engine's step alone
    turn_ms: float  # from the step's start to the next step's start, or to the loop's return to idle
    gc_ms: float = 0.0  # of the turn, the time the process spent collecting garbage (any thread: the GIL is held)
    wait_ms: float = 0.0  # of engine_ms, the host's wait for the device: the step before, a decode graph's previous
    # replay (overlapped scheduling: near 0 when the host, not the device, sets the pace)
    free_pages: int = -1  # after the step: KV pages free or held only by the prefix cache (-1: not recorded)
    held_seqs: int = -1  # after the step: sequences holding pages (running, waiting, reserved, being handed off)


def rank_trace_path(path: str, role: str, rank: int) -> str:
    """The file rank `rank` of a `role` worker started with `--step-trace PATH` writes: the prefill and the decode
    worker of a pair given the same flags write apart."""
    return f"{path}.{role}.rank{rank}"


class StepTrace:
    """Written by one thread (the rank's step thread)."""

    def __init__(self, path: str | Path, flush_interval_s: float = FLUSH_INTERVAL_S):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - open until close()
        self._lines: list[bytes] = []
        self._encoder = msgspec.json.Encoder()
        self._flush_interval_s = flush_interval_s
        self._opened_s = self._flushed_s = time.monotonic()

    def record(self, shape: StepShape, started_s: float, engine_ms: float, ended_s: float, gc_ms: float = 0.0,
               wait_ms: float = 0.0, free_pages: int = -1, held_seqs: int = -1) -> None:
        """A step that started at `started_s` (monotonic) and whose turn ended at `ended_s`."""
        record = StepRecord(round(started_s - self._opened_s, 6), shape, round(engine_ms, 4),
                            round((ended_s - started_s) * 1000, 4), round(gc_ms, 4), round(wait_ms, 4), free_pages,
                            held_seqs)
        self._lines.append(self._encoder.encode(record) + b"\n")
        if ended_s - self._flushed_s >= self._flush_interval_s:
            self.flush()

    def flush(self) -> None:
        self._flushed_s = time.monotonic()
        if self._lines:
            pending = memoryview(b"".join(self._lines))  # whole lines in one append
            self._lines.clear()
            while pending:
                pending = pending[self._file.write(pending):]

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()


def read_trace(path: str | Path) -> list[StepRecord]:
    """A trace as written, or gzipped (`.gz`: how the docs keep long ones)."""
    decoder = msgspec.json.Decoder(StepRecord)
    raw = Path(path).read_bytes()
    if str(path).endswith(".gz"):
        raw = gzip.decompress(raw)
    return [decoder.decode(line) for line in raw.splitlines() if line.strip()]
