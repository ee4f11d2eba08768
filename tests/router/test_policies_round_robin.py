"""The round-robin policy on plain stub snapshots."""

from pdserve.wire.protocol import RankLoad
from pdserve_router.policies import RoutingRequest, make_policy

RANKS = [("http://a", 0), ("http://a", 1), ("http://b", 0)]


def test_each_rank_is_chosen_in_turn_ignoring_prefix_and_load():
    policy = make_policy("round_robin", prefix_weight=1.0, load_weight=0.5)
    loads = {RANKS[0]: RankLoad(0, running=50, waiting=50, free_pages=0, total_pages=10, prefix_cache_pages=0)}
    chosen = [policy(RANKS, loads, {RANKS[2]: 1000}, RoutingRequest(10, sequence)) for sequence in range(6)]
    assert chosen == RANKS + RANKS
