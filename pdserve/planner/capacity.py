"""What one rank can take at the SLO, from the model's step profile (the same file the simulated engine steps by):
prefill tokens per second, and the share of it to plan for so that prompts queueing behind each other still meet the
time-to-first-token target; and the decode batch whose step fits the inter-token latency target, with the tokens per
second that batch produces."""

import math
from dataclasses import dataclass

from pdserve.engine.step_profile import StepProfile


@dataclass(frozen=True)
class DecodeCapacity:
    batch: int  # sequences a rank decodes at once within the ITL target
    step_s: float  # its step time
    meets_itl: bool  # False: even one sequence steps slower than the target (the rank runs batch 1 anyway)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s


def prefill_tokens_per_s(profile: StepProfile, chunk_tokens: int) -> float:
    """A prefill rank's throughput when it runs full chunks back to back."""
    return chunk_tokens / (profile.prefill_step_ms(chunk_tokens) / 1000)


def decode_capacity(profile: StepProfile, step_target_s: float, context_tokens: float,
                    max_batch: int) -> DecodeCapacity:
    """The largest batch (at most `max_batch`, and what the KV pool holds at this context) whose decode step takes
    at most `step_target_s`; step time grows with the batch, so a bisection finds it."""
    pool_batch = int(profile.kv_pool_tokens // max(context_tokens, 1.0))
    high = max(1, min(max_batch, pool_batch))

    def step_s(batch: int) -> float:
        return profile.decode_step_ms(batch, context_tokens) / 1000

    if step_s(1) > step_target_s:
        return DecodeCapacity(1, step_s(1), meets_itl=False)
    low = 1  # step_s(low) fits; find the largest that does
    while low < high:
        middle = (low + high + 1) // 2
        if step_s(middle) <= step_target_s:
            low = middle
        else:
            high = middle - 1
    return DecodeCapacity(low, step_s(low), meets_itl=True)


def prefill_utilization_for_ttft(service_s: float, ttft_budget_s: float, cap: float) -> float:
    """The largest share of a prefill rank's throughput (at most `cap`) at which a prompt's p99 wait in the rank's
    queue plus its own prefill (`service_s`, a mean prompt at the rank's throughput) fits `ttft_budget_s`.

    The queue is taken as M/M/1, whose waits have P(W > t) = rho exp(-(1 - rho) t / S): Poisson arrivals (what a
    router sees of many clients) and exponential service, a deliberate overestimate for prompts packed into chunks.
    Where even an empty queue misses the budget no share helps (more ranks do not make one prompt faster): `cap`."""
    if service_s >= ttft_budget_s:
        return cap

    def p99_ttft_s(rho: float) -> float:
        if rho >= 1:
            return math.inf  # the queue grows without bound
        wait = service_s * math.log(100 * rho) / (1 - rho) if rho > 0.01 else 0.0
        return wait + service_s

    low, high = 0.0, cap  # p99_ttft_s grows with rho: bisect for the largest that fits
    if p99_ttft_s(high) <= ttft_budget_s:
        return cap
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if p99_ttft_s(middle) <= ttft_budget_s else (low, middle)
    return low
