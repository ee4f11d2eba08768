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


@dataclass(frozen=True)
class LocalPrefillRule:
    """Conditional disaggregation: a short prompt whose prefill rank is busy is prefilled on its decode rank (plan
    `both`) instead of queueing behind long prefills and paying for a KV hand-off it barely needs, as long as
    computing it there stalls that rank's decodes briefly. Busy and brief are measured: the ranks report the prompt
    tokens they have queued and the prefill speed of their recent steps (pdserve.worker.prefill_rate)."""

    # Prompts of at most this many tokens (all of them: the decode rank holds no prefix for them); 0: never.
    max_tokens: int = 0
    min_prefill_queue: int = 1  # ...when the prefill rank has at least this many requests running or waiting,
    min_wait_s: float = 0.0  # ...its queued prompt tokens would take it at least this long (0: no test),
    # ...and the decode rank computes the prompt, after the prompts already queued there, within this long (0: no
    # limit): the stall its running decodes take
    max_stall_s: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def prefill_on_decode(self, prompt_tokens: int, prefill_queue: int, queued_prompt_tokens: int,
                          prefill_rate: float, decode_queued_prompt_tokens: int, decode_rate: float) -> bool:
        """`prefill_queue`, `queued_prompt_tokens`, `prefill_rate`: requests, prompt tokens still to compute and
        measured prompt tokens per second of the prefill rank chosen for the prompt; the decode rank's prompt tokens
        and rate likewise (its rate 0 where it has not prefilled yet: the prefill rank's stands in, the same model
        on the same kind of GPU). A wait cannot be told without a rate, so a rank not yet measured is never
        busy by `min_wait_s`."""
        if prompt_tokens > self.max_tokens or prefill_queue < self.min_prefill_queue:
            return False
        if self.min_wait_s and (not prefill_rate or queued_prompt_tokens / prefill_rate < self.min_wait_s):
            return False
        rate = decode_rate or prefill_rate
        stall_s = (decode_queued_prompt_tokens + prompt_tokens) / rate if rate else 0.0
        return not (self.max_stall_s and stall_s > self.max_stall_s)


def make_policy(name: str, prefix_weight: float, load_weight: float) -> Policy:
    if name == "prefix":
        return functools.partial(route_prefix, prefix_weight=prefix_weight, load_weight=load_weight)
    if name == "round_robin":
        return route_round_robin
    if name == "least_load":
        return route_least_load
    raise ValueError(f"unknown routing policy {name!r}; expected prefix, round_robin or least_load")
