"""The least-load policy (and the decode choice, which uses it) on plain stub snapshots."""

import pytest

from pdserve.wire.protocol import RankLoad
from pdserve_router.policies import RoutingRequest, choose_decode, make_policy, normalized_loads

A, B = ("http://a", 0), ("http://b", 0)


def load(running: int, waiting: int, free_pages: int) -> RankLoad:
    return RankLoad(0, running=running, waiting=waiting, free_pages=free_pages, total_pages=100, prefix_cache_pages=0)


def test_fewer_queued_requests_wins_and_prefix_is_ignored():
    policy = make_policy("least_load", prefix_weight=1.0, load_weight=0.5)
    loads = {A: load(5, 5, 50), B: load(1, 0, 50)}
    assert policy([A, B], loads, {A: 10_000}, RoutingRequest(100, 0)) == B


def test_free_pages_break_equal_queues():
    policy = make_policy("least_load", prefix_weight=1.0, load_weight=0.5)
    loads = {A: load(2, 0, 10), B: load(2, 0, 90)}
    assert policy([A, B], loads, {}, RoutingRequest(100, 0)) == B


def test_decode_choice_prefers_free_pages_and_short_queues():
    loads = {A: load(3, 2, 5), B: load(3, 2, 80)}
    assert choose_decode([A, B], loads, sequence_number=0) == B


def test_normalized_load_is_half_queue_half_pages():
    loads = {A: load(4, 0, 50), B: load(0, 0, 100)}
    assert normalized_loads([A, B], loads) == {A: pytest.approx(0.75), B: pytest.approx(0.0)}


def test_unknown_policy_name_is_rejected():
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", 1.0, 1.0)
