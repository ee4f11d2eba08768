"""The round-robin policy on plain load lists."""

from pdserve_router.policies import CandidateLoads, RoutingRequest, make_policy


def test_each_rank_is_chosen_in_turn_ignoring_prefix_and_load():
    policy = make_policy("round_robin", prefix_weight=1.0, load_weight=0.5)
    loads = CandidateLoads([100, 0, 0], [1.0, 0.0, 0.0])
    chosen = [policy(loads, {2: 1000}, RoutingRequest(10, sequence)) for sequence in range(6)]
    assert chosen == [0, 1, 2, 0, 1, 2]
