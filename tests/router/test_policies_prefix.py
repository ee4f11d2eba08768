"""The prefix policy on plain stub snapshots."""

from pdserve.wire.protocol import RankLoad
from pdserve_router.policies import RoutingRequest, make_policy, route_prefix

A, B, C = ("http://a", 0), ("http://b", 0), ("http://b", 1)


def idle(rank: int = 0) -> RankLoad:
    return RankLoad(rank=rank, running=0, waiting=0, free_pages=100, total_pages=100, prefix_cache_pages=0)


def busy(running: int, free_pages: int) -> RankLoad:
    return RankLoad(rank=0, running=running, waiting=0, free_pages=free_pages, total_pages=100, prefix_cache_pages=0)


def test_longest_cached_prefix_wins_when_loads_are_equal():
    loads = {A: idle(), B: idle(), C: idle()}
    chosen = route_prefix([A, B, C], loads, {A: 16, B: 64, C: 32}, RoutingRequest(100, 0), prefix_weight=1.0, load_weight=0.5)
    assert chosen == B


def test_heavy_load_outweighs_a_small_prefix_match():
    loads = {A: busy(running=20, free_pages=5), B: idle()}
    chosen = route_prefix([A, B], loads, {A: 8, B: 0}, RoutingRequest(100, 0), prefix_weight=1.0, load_weight=0.5)
    assert chosen == B


def test_long_prefix_match_outweighs_moderate_load():
    loads = {A: busy(running=4, free_pages=60), B: idle()}
    chosen = route_prefix([A, B], loads, {A: 90, B: 0}, RoutingRequest(100, 0), prefix_weight=1.0, load_weight=0.5)
    assert chosen == A


def test_zero_prefix_weight_degenerates_to_least_load():
    loads = {A: busy(running=1, free_pages=90), B: idle()}
    chosen = route_prefix([A, B], loads, {A: 100}, RoutingRequest(100, 0), prefix_weight=0.0, load_weight=1.0)
    assert chosen == B


def test_ties_rotate_with_the_request_counter_so_an_idle_cluster_spreads_work():
    policy = make_policy("prefix", prefix_weight=1.0, load_weight=0.5)
    loads = {A: idle(), B: idle(), C: idle()}
    chosen = {policy([A, B, C], loads, {}, RoutingRequest(10, sequence)) for sequence in range(3)}
    assert chosen == {A, B, C}


def test_ranks_not_polled_yet_count_as_idle():
    chosen = route_prefix([A, B], {A: busy(running=8, free_pages=10)}, {}, RoutingRequest(10, 0), prefix_weight=1.0, load_weight=0.5)
    assert chosen == B
