"""The least-load policy (and the decode choice, which uses it) on plain load lists."""

import pytest

from pdserve_router.policies import CandidateLoads, RoutingRequest, choose_decode, make_policy, normalized_loads


def loads(*queue_and_page_use: tuple[int, float]) -> CandidateLoads:
    """One (requests queued, fraction of pages in use) per candidate."""
    return CandidateLoads([q for q, _ in queue_and_page_use], [u for _, u in queue_and_page_use])


def test_fewer_queued_requests_wins_and_prefix_is_ignored():
    policy = make_policy("least_load", prefix_weight=1.0, load_weight=0.5)
    assert policy(loads((10, 0.5), (1, 0.5)), {0: 10_000}, RoutingRequest(100, 0)) == 1


def test_free_pages_break_equal_queues():
    policy = make_policy("least_load", prefix_weight=1.0, load_weight=0.5)
    assert policy(loads((2, 0.9), (2, 0.1)), {}, RoutingRequest(100, 0)) == 1


def test_decode_choice_prefers_free_pages_and_short_queues():
    assert choose_decode(loads((5, 0.95), (5, 0.2)), sequence_number=0) == 1
    assert choose_decode(loads((1, 0.5), (6, 0.5)), sequence_number=1) == 0


def test_equal_loads_rotate_with_the_request_counter():
    assert [choose_decode(loads((3, 0.5), (3, 0.5), (3, 0.5)), s) for s in range(4)] == [0, 1, 2, 0]


def test_normalized_load_is_half_queue_half_pages():
    assert normalized_loads(loads((4, 0.5), (0, 0.0))) == [pytest.approx(0.75), pytest.approx(0.0)]


def test_unknown_policy_name_is_rejected():
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", 1.0, 1.0)
