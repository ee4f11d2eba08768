"""Routing policies: pure functions of snapshots handed to them, never calling discovery or the network.

A policy is `route(loads, prefix_matches, request) -> position of the chosen candidate`, where the candidates are
the ranks that may take the request in a stable order (the caller holds them; a policy sees only positions):
  loads           each candidate's queue and page use, as arrays aligned with the candidates
  prefix_matches  prompt tokens cached on the few candidates holding some of the prompt, by position
  request         the prompt's length and the router's request counter
Arrays, not a record per rank: a decision at hundreds of ranks then reads a few contiguous arrays.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RoutingRequest:
    prompt_len: int
    sequence_number: int  # increases by one per routed request; round robin uses it


@dataclass(frozen=True)
class CandidateLoads:
    """The load of each candidate, aligned with the candidates: requests queued (running + waiting, plus the
    router's assignments since the last poll) and the fraction of KV pages in use (0 for a rank not polled yet)."""

    queue: np.ndarray  # int64
    page_use: np.ndarray  # float64


# (loads, prompt tokens cached by candidate position: positions left out hold none, request) -> chosen position
Policy = Callable[[CandidateLoads, dict[int, int], RoutingRequest], int]


def normalized_loads(loads: CandidateLoads) -> np.ndarray:
    """Load in [0, 1]: half queue depth relative to the busiest candidate, half the fraction of pages in use."""
    busiest = int(loads.queue.max(initial=0))
    return loads.queue * (0.5 / (busiest or 1)) + 0.5 * loads.page_use  # all idle: every queue is 0 anyway


def first_highest(scores: np.ndarray, start: int) -> int:
    """Position of the highest score; of equal ones, the first met going round from `start` (ties rotate)."""
    return (int(np.argmax(np.roll(scores, -start))) + start) % len(scores)


def route_round_robin(loads: CandidateLoads, prefix_matches: dict[int, int], request: RoutingRequest) -> int:
    return request.sequence_number % len(loads.queue)


def route_least_load(loads: CandidateLoads, prefix_matches: dict[int, int], request: RoutingRequest) -> int:
    return first_highest(-normalized_loads(loads), request.sequence_number % len(loads.queue))


def route_prefix(loads: CandidateLoads, prefix_matches: dict[int, int], request: RoutingRequest,
                 prefix_weight: float, load_weight: float) -> int:
    """score = prefix_weight * matched fraction of the prompt - load_weight * normalized load; highest wins."""
    scores = -load_weight * normalized_loads(loads)
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
    `both`) instead of queueing behind long prefills and paying for a KV hand-off it barely needs."""

    # Prompts of at most this many tokens (all of them: the decode rank holds no prefix for them); 0: never.
    max_tokens: int = 0
    min_prefill_queue: int = 1  # ...when the prefill rank has at least this many requests running or waiting

    def prefill_on_decode(self, prompt_tokens: int, prefill_queue: int) -> bool:
        """`prefill_queue`: requests running or waiting on the prefill rank chosen for the prompt."""
        return prompt_tokens <= self.max_tokens and prefill_queue >= self.min_prefill_queue


def make_policy(name: str, prefix_weight: float, load_weight: float) -> Policy:
    if name == "prefix":
        return functools.partial(route_prefix, prefix_weight=prefix_weight, load_weight=load_weight)
    if name == "round_robin":
        return route_round_robin
    if name == "least_load":
        return route_least_load
    raise ValueError(f"unknown routing policy {name!r}; expected prefix, round_robin or least_load")
