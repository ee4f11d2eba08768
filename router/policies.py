"""Routing policies: pure functions of snapshots handed to them, never calling discovery or the network.

A policy is `route(candidates, loads, prefix_matches, request) -> chosen candidate`:
  candidates      ranks that may take the request, as (worker url, rank), in a stable order
  loads           the last polled load of each rank (absent: not polled yet, treated as idle)
  prefix_matches  prompt tokens each rank already holds (from the prefix index)
  request         the prompt's length and the router's request counter
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.wire.protocol import RankLoad
from pdserve_router.prefix_index import RankKey


@dataclass(frozen=True)
class RoutingRequest:
    prompt_len: int
    sequence_number: int  # increases by one per routed request; round robin uses it


Policy = Callable[[list[RankKey], dict[RankKey, RankLoad], dict[RankKey, int], RoutingRequest], RankKey]


def normalized_loads(candidates: list[RankKey], loads: dict[RankKey, RankLoad]) -> dict[RankKey, float]:
    """Load in [0, 1]: half queue depth relative to the busiest candidate, half the fraction of pages in use."""
    rank_loads = [loads.get(key) for key in candidates]
    queues = [load.running + load.waiting if load else 0 for load in rank_loads]
    scale = 0.5 / (max(queues, default=0) or 1)  # all idle: every queue is 0 anyway
    return {
        key: queue * scale + (0.5 - 0.5 * load.free_pages / load.total_pages if load and load.total_pages else 0.0)
        for key, queue, load in zip(candidates, queues, rank_loads)
    }


def route_round_robin(candidates, loads, prefix_matches, request: RoutingRequest) -> RankKey:
    return candidates[request.sequence_number % len(candidates)]


def route_least_load(candidates, loads, prefix_matches, request: RoutingRequest) -> RankKey:
    normalized = normalized_loads(candidates, loads)
    start = request.sequence_number % len(candidates)
    best, best_load = candidates[start], float("inf")
    for key in candidates[start:] + candidates[:start]:  # ties (e.g. all idle) go round robin: the first one wins
        if normalized[key] < best_load:
            best, best_load = key, normalized[key]
    return best


def route_prefix(candidates, loads, prefix_matches, request: RoutingRequest, prefix_weight: float, load_weight: float) -> RankKey:
    """score = prefix_weight * matched fraction of the prompt - load_weight * normalized load; highest wins."""
    normalized = normalized_loads(candidates, loads)
    prompt_len = max(1, request.prompt_len)
    per_token = prefix_weight / prompt_len
    start = request.sequence_number % len(candidates)
    best, best_score = candidates[start], float("-inf")
    for key in candidates[start:] + candidates[:start]:  # the first of equal scores wins: ties go round robin
        matched = prefix_matches.get(key, 0)
        score = per_token * (matched if matched < prompt_len else prompt_len) - load_weight * normalized[key]
        if score > best_score:
            best, best_score = key, score
    return best


def choose_decode(candidates: list[RankKey], loads: dict[RankKey, RankLoad], sequence_number: int) -> RankKey:
    """Decode ranks hold no reusable prefix for a new request: the least loaded by queue and free pages."""
    return route_least_load(candidates, loads, {}, RoutingRequest(prompt_len=0, sequence_number=sequence_number))


@dataclass(frozen=True)
class LocalPrefillRule:
    """Conditional disaggregation: a short prompt whose prefill rank is busy is prefilled on its decode rank (plan
    `both`) instead of queueing behind long prefills and paying for a KV hand-off it barely needs."""

    # Prompts of at most this many tokens (all of them: the decode rank holds no prefix for them); 0: never.
    max_tokens: int = 0
    min_prefill_queue: int = 1  # ...when the prefill rank has at least this many requests running or waiting

    def prefill_on_decode(self, prompt_tokens: int, prefill_load: RankLoad | None) -> bool:
        if prompt_tokens > self.max_tokens:
            return False
        queue = prefill_load.running + prefill_load.waiting if prefill_load else 0
        return queue >= self.min_prefill_queue


def make_policy(name: str, prefix_weight: float, load_weight: float) -> Policy:
    if name == "prefix":
        return functools.partial(route_prefix, prefix_weight=prefix_weight, load_weight=load_weight)
    if name == "round_robin":
        return route_round_robin
    if name == "least_load":
        return route_least_load
    raise ValueError(f"unknown routing policy {name!r}; expected prefix, round_robin or least_load")
