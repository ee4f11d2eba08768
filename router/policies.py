"""Routing policies: pure functions of snapshots handed to them, never calling discovery or the network.

A policy is `route(loads, prefix_matches, request) -> position of the chosen candidate`, where the candidates are
the ranks that may take the request in a stable order (the caller holds them; a policy sees only positions):
  loads           each candidate's queue and page use, as lists aligned with the candidates
  prefix_matches  prompt tokens cached on the few candidates holding some of the prompt, by position
  request         the prompt's length and the router's request counter
Plain lists scored in one comprehension: at 1-128 candidates that is faster than numpy, whose per-call overhead
(~10 us a decision) is most of a small cluster's routing cost.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingRequest:
    prompt_len: int
    sequence_number: int  # increases by one per routed request; round robin uses it


@dataclass(frozen=True)
class CandidateLoads:
    """The load of each candidate, aligned with the candidates: requests queued (running + waiting, plus the
    router's assignments since the last poll) and the fraction of KV pages in use (0 for a rank not polled yet)."""

    queue: list[int]
    page_use: list[float]


# (loads, prompt tokens cached by candidate position: positions left out hold none, request) -> chosen position
Policy = Callable[[CandidateLoads, dict[int, int], RoutingRequest], int]


def normalized_loads(loads: CandidateLoads, weight: float = 1.0) -> list[float]:
    """`weight` x load in [0, 1]: half queue depth relative to the busiest candidate, half the fraction of pages in
    use."""
    scale = 0.5 * weight / (max(loads.queue, default=0) or 1)  # all idle: every queue is 0 anyway
    half_weight = 0.5 * weight
    return [queue * scale + half_weight * use for queue, use in zip(loads.queue, loads.page_use)]


def first_highest(scores: list[float], start: int) -> int:
    """Position of the highest score; of equal ones, the first met going round from `start` (ties rotate)."""
    best = max(scores)
    try:
        return scores.index(best, start)
    except ValueError:  # every best lies before `start`
        return scores.index(best)


def route_round_robin(loads: CandidateLoads, prefix_matches: dict[int, int], request: RoutingRequest) -> int:
    return request.sequence_number % len(loads.queue)


def route_least_load(loads: CandidateLoads, prefix_matches: dict[int, int], request: RoutingRequest) -> int:
    return first_highest(normalized_loads(loads, -1.0), request.sequence_number % len(loads.queue))


def route_prefix(loads: CandidateLoads, prefix_matches: dict[int, int], request: RoutingRequest,
                 prefix_weight: float, load_weight: float) -> int:
    """score = prefix_weight * matched fraction of the prompt - load_weight * normalized load; highest wins."""
    scores = normalized_loads(loads, -load_weight)
    prompt_len = max(1, request.prompt_len)
    per_token = prefix_weight / prompt_len
    for position, matched in prefix_matches.items():
        scores[position] += per_token * min(matched, prompt_len)
    return first_highest(scores, request.sequence_number % len(scores))


def choose_decode(loads: CandidateLoads, sequence_number: int) -> int:
    """Decode ranks hold no reusable prefix for a new request: the least loaded by queue and free pages."""
    return route_least_load(loads, {}, RoutingRequest(prompt_len=0, sequence_number=sequence_number))


MAX_SAVED_LONG_STEPS = 16.0  # a quiet decode rank saves up at most this many long steps: one long document's chunks


class LongStepAllowance:
    """One decode rank's allowance of steps longer than LocalPrefillRule.max_stall_s: each of its decode steps earns
    `long_step_share` of one, and a prompt prefilled there spends one for each chunk step it makes long. An ITL
    percentile tolerates a share of long gaps, not a number: the allowance keeps their share of the rank's steps,
    whatever its batch and step time (a long prompt now and then at low rates, none at a busy rank's high ones)."""

    def __init__(self) -> None:
        self.saved = MAX_SAVED_LONG_STEPS
        self._earned_until_s: float | None = None

    def earn(self, now_s: float, decode_step_s: float, share: float) -> None:
        if self._earned_until_s is not None and decode_step_s > 0:
            steps = (now_s - self._earned_until_s) / decode_step_s
            self.saved = min(MAX_SAVED_LONG_STEPS, self.saved + steps * share)
        self._earned_until_s = now_s


@dataclass(frozen=True)
class LocalPrefillRule:
    """Conditional disaggregation: a prompt whose prefill rank is busy is prefilled on its decode rank (plan `both`)
    instead of queueing behind other prefills and paying for a KV hand-off, as long as the decode rank's requests
    barely feel it. Busy and barely are measured: the ranks report the prompt tokens they have queued, the prefill
    speed and the decode step of their recent steps (pdserve.worker.step_speeds), and the most prompt tokens a step
    computes beside decodes (a decode worker's --mixed-prefill-tokens: a long prompt goes in chunks)."""

    # Prompts of at most this many tokens (all of them: the decode rank holds no prefix for them); 0: never.
    max_tokens: int = 0
    min_prefill_queue: int = 1  # ...when the prefill rank has at least this many requests running or waiting,
    min_wait_s: float = 0.0  # ...its queued prompt tokens would take it at least this long (0: no test),
    # ...and the decode rank's steps while it computes its queued prompts and this one last at most this long: its
    # decode step plus one chunk, the inter-token gap its running requests then see (0: no test). With this test the
    # decode rank must also be done with the prompt sooner than the prefill rank would be.
    max_stall_s: float = 0.0
    # ...or, longer, make at most this share of the decode rank's steps long (LongStepAllowance; 0: none)
    long_step_share: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def prefill_on_decode(self, prompt_tokens: int, prefill_queue: int, queued_prompt_tokens: int,
                          prefill_rate: float, decode_queued_prompt_tokens: int, decode_step_s: float,
                          decode_chunk_tokens: int, allowance: LongStepAllowance | None = None,
                          now_s: float = 0.0) -> bool:
        """`prefill_queue`, `queued_prompt_tokens`, `prefill_rate`: requests, prompt tokens still to compute and
        measured prompt tokens per second of the prefill rank chosen for the prompt; the decode rank's prompt tokens
        still to compute, its decode step (0: idle or not measured) and its chunk (0: the whole prompt at once), and
        its allowance of long steps (spent here when the prompt goes there). The prefill rank's speed stands in for
        the decode rank's (the same model on the same kind of GPU), so without it neither a wait nor a step can be
        told: such a rank is never busy by `min_wait_s` or brief by `max_stall_s`."""
        if prompt_tokens > self.max_tokens or prefill_queue < self.min_prefill_queue:
            return False
        if self.min_wait_s and (not prefill_rate or queued_prompt_tokens / prefill_rate < self.min_wait_s):
            return False
        if not self.max_stall_s:
            return True
        if not prefill_rate:
            return False
        local_tokens = decode_queued_prompt_tokens + prompt_tokens
        chunk = min(decode_chunk_tokens or local_tokens, local_tokens)
        step_s = decode_step_s + chunk / prefill_rate
        steps = math.ceil(local_tokens / chunk)
        if steps * step_s >= (queued_prompt_tokens + prompt_tokens) / prefill_rate:
            return False  # not done sooner than on the prefill rank
        if step_s <= self.max_stall_s:
            return True
        if allowance is None or not self.long_step_share:
            return False
        allowance.earn(now_s, decode_step_s, self.long_step_share)
        long_steps = math.ceil(prompt_tokens / chunk)  # this prompt's (the queued ones have paid for theirs)
        if allowance.saved < long_steps:
            return False
        allowance.saved -= long_steps
        return True


def make_policy(name: str, prefix_weight: float, load_weight: float) -> Policy:
    if name == "prefix":
        return functools.partial(route_prefix, prefix_weight=prefix_weight, load_weight=load_weight)
    if name == "round_robin":
        return route_round_robin
    if name == "least_load":
        return route_least_load
    raise ValueError(f"unknown routing policy {name!r}; expected prefix, round_robin or least_load")
