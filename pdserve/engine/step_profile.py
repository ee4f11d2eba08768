"""A measured step-time profile of one model on one GPU: loaded from its JSON (profiles/), it predicts what a decode,
prefill or mixed step takes. The simulated engine sleeps its predictions and the planner sizes pools by them, so it
imports no torch (the planner runs in the router's image)."""

import json
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # step_shape imports the scheduler, and through it torch
    from pdserve.engine.step_shape import StepShape

DEFAULT_PROFILE = Path(__file__).parent / "profiles" / "v2-lite-h100.json"


def interpolate(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise linear through (xs, ys), extended linearly past both ends, never below 0."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return max(0.0, ys[i] + slope * (x - xs[i]))


@dataclass(frozen=True)
class StepProfile:
    """Measured step times of one model on one GPU: decode steps by batch and context, prefill by tokens."""

    name: str
    decode_batches: list[int]
    decode_contexts: list[int]
    decode_ms: list[list[float]]  # [batch][context]
    prefill_tokens: list[int]
    prefill_ms: list[float]
    kv_bytes_per_token: int
    kv_pool_tokens: int
    kv_write_gb_per_s: float  # one prefill -> decode KV write, alone on the link

    @classmethod
    def load(cls, path: str | Path) -> "StepProfile":
        raw = json.loads(Path(path).read_text())
        decode, prefill = raw["decode_ms"], raw["prefill_ms"]
        profile = cls(raw["name"], decode["batches"], decode["contexts"], decode["ms"], prefill["tokens"],
                      prefill["ms"], raw["kv_bytes_per_token"], raw["kv_pool_tokens"], raw["kv_write_gb_per_s"])
        rows = len(profile.decode_ms) == len(profile.decode_batches)
        if not rows or any(len(row) != len(profile.decode_contexts) for row in profile.decode_ms):
            raise ValueError(f"{path}: decode_ms must be one row per batch, one column per context")
        if len(profile.prefill_ms) != len(profile.prefill_tokens):
            raise ValueError(f"{path}: prefill_ms must have one time per token count")
        return profile

    def decode_step_ms(self, batch: int, mean_context: float) -> float:
        per_batch = [interpolate(mean_context, self.decode_contexts, row) for row in self.decode_ms]
        return interpolate(batch, self.decode_batches, per_batch)

    def prefill_step_ms(self, tokens: int) -> float:
        return interpolate(tokens, self.prefill_tokens, self.prefill_ms)

    def step_ms(self, shape: "StepShape") -> float:
        """Decodes and prefill chunks of one step share its weight reads: a mixed step costs the decode batch plus
        what the prefill tokens add over a one-token step."""
        prefill_tokens = shape.prefill_tokens
        if not shape.decode_batch:
            return self.prefill_step_ms(prefill_tokens) if prefill_tokens else 0.0
        extra = self.prefill_step_ms(prefill_tokens) - self.prefill_step_ms(1) if prefill_tokens else 0.0
        return self.decode_step_ms(shape.decode_batch, shape.decode_context) + max(0.0, extra)
