"""Fits a step profile (the JSON that step_profile.py loads) to a step trace taken in service (step_trace.py),
so that a simulated step costs what a worker's step loop took per step, host work included.

Each grid point is the median turn time of the steps nearest to it: decode-only steps for the decode grid (by batch
and mean context), steps of one prompt's chunk alone for the prefill points (by tokens). A step counts only within
`max_relative_distance` of its nearest point. A point without steps is never filled in: a prefill point is left out,
and a decode grid with a hole loses the batch row or context column with the most holes until none is left; every
point left out is named in `ProfileFit.missing`. One exception, stated in `ProfileFit.notes` and the profile's
source: an unseen 1-token prefill point is the batch-1 decode step, as in the kernel profile, so that a mixed step
still costs its decode batch plus what its prefill tokens add."""

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.engine.step_profile import StepProfile
from pdserve.engine.step_trace import StepRecord


@dataclass(frozen=True)
class FitGrid:
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[float, ...]
    prefill_tokens: tuple[int, ...]
    max_relative_distance: float = 0.25  # a step further than this from its nearest point (either axis) is unused

    def __post_init__(self) -> None:
        for name in ("decode_batches", "decode_contexts", "prefill_tokens"):
            points = getattr(self, name)
            if not points or any(p <= 0 for p in points) or list(points) != sorted(set(points)):
                raise ValueError(f"{name} must be positive and strictly ascending, got {points}")
        if self.max_relative_distance <= 0:
            raise ValueError(f"max_relative_distance must be > 0, got {self.max_relative_distance}")

    @classmethod
    def of(cls, profile: StepProfile) -> "FitGrid":
        """The grid `profile` was measured on."""
        return cls(tuple(profile.decode_batches), tuple(profile.decode_contexts), tuple(profile.prefill_tokens))

    def nearest(self, value: float, points: tuple[float, ...]) -> int | None:
        """Index of the point nearest `value` (on a log scale), or None if it is further than allowed."""
        if value <= 0:
            return None
        index = min(range(len(points)), key=lambda i: abs(math.log(value / points[i])))
        return index if abs(math.log(value / points[index])) <= math.log1p(self.max_relative_distance) else None


@dataclass
class ProfileFit:
    profile: dict  # StepProfile JSON, with the samples behind each point under "samples"
    missing: list[str] = field(default_factory=list)  # grid points without steps, left out of the profile
    notes: list[str] = field(default_factory=list)  # points not measured directly, and how they were made


def fit_profile(records: Iterable[StepRecord], base: StepProfile, grid: FitGrid, name: str,
                source: str, every_prefill_step: bool = False) -> ProfileFit:
    """A profile of `records`' medians on `grid`; the KV figures (bytes per token, pool, write rate) are `base`'s.
    `every_prefill_step`: prefill points from every prefill-only step by its tokens, several prompts' chunks
    together too (a loaded P/D prefill worker runs mostly those, and they cost more than one prompt's chunk of the
    same tokens), not only one prompt's chunk alone. Raises ValueError when no decode point or no prefill point has
    a step."""
    decode_turns, prefill_turns = _binned(records, grid, every_prefill_step)
    fit = ProfileFit({})
    rows, columns = _complete_grid(grid, decode_turns, fit.missing)
    if not rows or not columns:
        raise ValueError(f"no decode-only step near any point of {grid}; missing: {fit.missing}")
    decode_ms = [[round(statistics.median(decode_turns[b, c]), 3) for c in columns] for b in rows]
    tokens, prefill_ms, prefill_samples = [], [], []
    for p, count in enumerate(grid.prefill_tokens):
        if p in prefill_turns:
            tokens.append(count)
            prefill_ms.append(round(statistics.median(prefill_turns[p]), 3))
            prefill_samples.append(len(prefill_turns[p]))
        elif count == 1 and grid.decode_batches[rows[0]] == 1:
            tokens.append(1)
            prefill_ms.append(decode_ms[0][0])
            prefill_samples.append(0)
            fit.notes.append(f"prefill at 1 token = the batch-1 decode step at context "
                             f"{grid.decode_contexts[columns[0]]:g} ({decode_ms[0][0]} ms)")
        else:
            fit.missing.append(f"prefill {count} tokens: no step of one prompt's chunk alone")
    if not tokens:
        raise ValueError(f"no prefill step near any point of {grid}; missing: {fit.missing}")
    fit.profile = {
        "name": name,
        "source": source + "".join(f"; {note}" for note in fit.notes),
        "decode_ms": {"batches": [grid.decode_batches[b] for b in rows],
                      "contexts": [grid.decode_contexts[c] for c in columns], "ms": decode_ms},
        "prefill_ms": {"tokens": tokens, "ms": prefill_ms},
        "kv_bytes_per_token": base.kv_bytes_per_token,
        "kv_pool_tokens": base.kv_pool_tokens,
        "kv_write_gb_per_s": base.kv_write_gb_per_s,
        "samples": {"decode": [[len(decode_turns[b, c]) for c in columns] for b in rows], "prefill": prefill_samples},
        "missing": fit.missing,
    }
    return fit


def _binned(records: Iterable[StepRecord], grid: FitGrid,
            every_prefill_step: bool) -> tuple[dict[tuple[int, int], list[float]], dict[int, list[float]]]:
    """Turn times by decode grid cell (batch index, context index) and by prefill point index."""
    decode_turns: dict[tuple[int, int], list[float]] = {}
    prefill_turns: dict[int, list[float]] = {}
    for record in records:
        shape = record.shape
        if shape.decode_batch and not shape.prefill_tokens:
            b = grid.nearest(shape.decode_batch, grid.decode_batches)
            c = grid.nearest(shape.decode_context, grid.decode_contexts)
            if b is not None and c is not None:
                decode_turns.setdefault((b, c), []).append(record.turn_ms)
        elif not shape.decode_batch and (shape.prefill_seqs == 1 or every_prefill_step and shape.prefill_seqs):
            p = grid.nearest(shape.prefill_tokens, grid.prefill_tokens)
            if p is not None:
                prefill_turns.setdefault(p, []).append(record.turn_ms)
    return decode_turns, prefill_turns


def _complete_grid(grid: FitGrid, turns: dict[tuple[int, int], list[float]],
                   missing: list[str]) -> tuple[list[int], list[int]]:
    """Rows (batch indices) and columns (context indices) whose every cell has steps: while a cell is empty, the
    row or column emptiest in proportion goes (of two alike, the one with fewer measured cells; then the row).
    Names each empty cell and each point dropped in `missing`."""
    rows, columns = list(range(len(grid.decode_batches))), list(range(len(grid.decode_contexts)))
    for b in rows:
        for c in columns:
            if (b, c) not in turns:
                missing.append(f"decode batch {grid.decode_batches[b]} x context {grid.decode_contexts[c]:g}: "
                               "no decode-only step")
    while rows and columns:
        lines = [("row", b, [(b, c) for c in columns]) for b in rows]
        lines += [("column", c, [(b, c) for b in rows]) for c in columns]
        kind, index, cells = max(lines, key=lambda line: _emptiness(line[2], turns))
        if not _emptiness(cells, turns)[0]:
            break
        if kind == "row":
            rows.remove(index)
            missing.append(f"decode batch {grid.decode_batches[index]} left out")
        else:
            columns.remove(index)
            missing.append(f"decode context {grid.decode_contexts[index]:g} left out")
    return rows, columns


def _emptiness(cells: list[tuple[int, int]], turns: dict[tuple[int, int], list[float]]) -> tuple[float, int]:
    """Share of `cells` without steps, then minus the cells with steps (losing fewer measured cells is better)."""
    empty = sum(cell not in turns for cell in cells)
    return empty / len(cells), -(len(cells) - empty)
