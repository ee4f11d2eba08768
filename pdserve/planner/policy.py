"""The decision: how many prefill and decode workers the traffic of the last interval, extrapolated over the time a
new worker takes to start, needs at the SLO. Capacity comes from the step profile; measured latency corrects it (a
pool whose p99 misses its target gets one more worker than the model asked for, at once where the model has it
loaded, after a second miss in a row where not, and not again while the workers already added for misses have only
lowered its load); pools grow at once and shrink only to the largest size needed over a window, so a dip between
bursts does not stop workers that must start again."""

import math
from collections import deque
from dataclasses import dataclass

from pdserve.engine.step_profile import StepProfile
from pdserve.planner.capacity import decode_capacity, prefill_tokens_per_s, prefill_utilization_for_ttft
from pdserve.planner.config import PlannerConfig
from pdserve.planner.traffic import Traffic

TREND_POINTS = 4  # intervals the rate's trend is fitted over
# Lengths assumed until the first request finishes: a chat turn.
DEFAULT_PROMPT_TOKENS, DEFAULT_OUTPUT_TOKENS = 1024.0, 256.0
# A pool the model has at least this loaded takes a latency miss as its own at once; a lighter one only a miss that
# repeats in the next interval (one slow interval there is a long prompt or a host hiccup, not too few workers).
LOADED_SHARE = 0.5


@dataclass(frozen=True)
class PoolSizes:
    prefill: int
    decode: int


@dataclass(frozen=True)
class Decision:
    at_s: float
    predicted_rate: float  # requests per second expected `lookahead_s` ahead
    needed: PoolSizes  # what the capacity model and the latency correction ask for
    target: PoolSizes  # after the scale-down window and the bounds
    reasons: tuple[str, ...]


def rate_trend(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (time, rate); 0 for fewer than two points."""
    if len(points) < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / len(points)
    mean_r = sum(r for _, r in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (r - mean_r) for t, r in points) / spread if spread else 0.0


class Planner:
    def __init__(self, cfg: PlannerConfig, profile: StepProfile) -> None:
        self.cfg = cfg
        self.profile = profile
        self.prefill_rank_tokens_per_s = prefill_tokens_per_s(profile, cfg.prefill_chunk_tokens)
        self._rates: deque[tuple[float, float]] = deque(maxlen=TREND_POINTS)
        self._needs: deque[tuple[float, PoolSizes]] = deque()
        self._prompt_tokens, self._output_tokens = DEFAULT_PROMPT_TOKENS, DEFAULT_OUTPUT_TOKENS
        # Per pool (prefill, decode): its latency over target in the last interval, and the modelled load at which a
        # worker was last added for a miss (None once an interval passes without one).
        self._missed = [False, False]
        self._corrected_at_load: list[float | None] = [None, None]

    def decide(self, traffic: Traffic, current: PoolSizes, at_s: float) -> Decision:
        cfg = self.cfg
        self._rates.append((at_s, traffic.request_rate))
        if traffic.mean_prompt_tokens > 0:  # some request finished: lengths known
            self._prompt_tokens, self._output_tokens = traffic.mean_prompt_tokens, traffic.mean_output_tokens
        # Rising load is planned for where it will be once a new worker is up; falling load, where it is now.
        rate = max(traffic.request_rate, traffic.request_rate + rate_trend(list(self._rates)) * cfg.lookahead_s)

        utilization = prefill_utilization_for_ttft(self._prompt_tokens / self.prefill_rank_tokens_per_s,
                                                   cfg.slo_ttft_s * cfg.ttft_headroom, cfg.prefill_utilization)
        prefill_ranks = rate * self._prompt_tokens / (self.prefill_rank_tokens_per_s * utilization)
        decode = decode_capacity(self.profile, cfg.slo_itl_s * cfg.itl_headroom,
                                 self._prompt_tokens + self._output_tokens / 2, cfg.max_decode_batch)
        decode_ranks = rate * self._output_tokens / decode.tokens_per_s
        needed = PoolSizes(math.ceil(prefill_ranks / cfg.prefill_ranks_per_worker - 1e-9),
                           math.ceil(decode_ranks / cfg.decode_ranks_per_worker - 1e-9))
        reasons = [(f"rate {traffic.request_rate:.2f}/s -> {rate:.2f}/s planned, prompt {self._prompt_tokens:.0f} "
                    f"output {self._output_tokens:.0f} tokens; prefill at {utilization:.0%} of a rank; decode batch "
                    f"{decode.batch} at {decode.step_s * 1e3:.1f} ms/step")]
        if not decode.meets_itl:
            reasons.append("one sequence alone steps slower than the ITL target: no pool size meets it")
        # The model's load on the pools as they are, each as a share of what it takes at the SLO.
        prefill_load = prefill_ranks / max(current.prefill * cfg.prefill_ranks_per_worker, 1)
        decode_load = decode_ranks / max(current.decode * cfg.decode_ranks_per_worker, 1)
        ttft = f"TTFT p99 {traffic.ttft_p99_s:.2f} s"
        if self._corrects(0, traffic.ttft_p99_s > cfg.slo_ttft_s, prefill_load, needed.prefill <= current.prefill,
                          ttft, reasons):
            needed = PoolSizes(current.prefill + 1, needed.decode)
            reasons.append(f"{ttft} over target: one prefill worker more")
        itl = f"ITL p99 {traffic.itl_p99_s * 1e3:.0f} ms"
        if self._corrects(1, traffic.itl_p99_s > cfg.slo_itl_s, decode_load, needed.decode <= current.decode,
                          itl, reasons):
            needed = PoolSizes(needed.prefill, current.decode + 1)
            reasons.append(f"{itl} over target: one decode worker more")

        self._needs.append((at_s, needed))
        while self._needs[0][0] < at_s - cfg.scale_down_window_s:
            self._needs.popleft()
        target = PoolSizes(
            min(max(max(n.prefill for _, n in self._needs), cfg.min_prefill), cfg.max_prefill),
            min(max(max(n.decode for _, n in self._needs), cfg.min_decode), cfg.max_decode))
        return Decision(at_s, rate, needed, target, tuple(reasons))

    def _corrects(self, pool: int, missed: bool, load: float, model_suffices: bool, measured: str,
                  reasons: list[str]) -> bool:
        """Whether a latency miss of `pool` (0 prefill, 1 decode) at this modelled `load` earns it a worker beyond
        what the model asks. A miss the model already answers needs none. A loaded pool's always does; a light
        pool's only when it repeats, and not while a worker added for an earlier miss has only lowered the load: one
        more did not help there, so the miss is not a lack of workers."""
        repeated, corrected_at = self._missed[pool], self._corrected_at_load[pool]
        self._missed[pool] = missed
        if not missed:
            self._corrected_at_load[pool] = None
            return False
        if not model_suffices:
            return False
        if load < LOADED_SHARE:
            if not repeated:
                reasons.append(f"{measured} over target at {load:.0%} modelled load: counted if it repeats")
                return False
            if corrected_at is not None and load < corrected_at:
                reasons.append(f"{measured} over target at {load:.0%} modelled load, after a worker added for it at "
                               f"{corrected_at:.0%}: not counted")
                return False
        self._corrected_at_load[pool] = load
        return True
