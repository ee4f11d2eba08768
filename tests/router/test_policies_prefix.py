"""The prefix policy on plain load lists."""

import random

from pdserve_router.policies import CandidateLoads, RoutingRequest, make_policy, route_prefix


def loads(*queue_and_page_use: tuple[int, float]) -> CandidateLoads:
    """One (requests queued, fraction of pages in use) per candidate."""
    return CandidateLoads([q for q, _ in queue_and_page_use], [u for _, u in queue_and_page_use])


IDLE = (0, 0.0)


def test_longest_cached_prefix_wins_when_loads_are_equal():
    chosen = route_prefix(loads(IDLE, IDLE, IDLE), {0: 16, 1: 64, 2: 32}, RoutingRequest(100, 0), prefix_weight=1.0,
                          load_weight=0.5)
    assert chosen == 1


def test_heavy_load_outweighs_a_small_prefix_match():
    chosen = route_prefix(loads((20, 0.95), IDLE), {0: 8}, RoutingRequest(100, 0), prefix_weight=1.0, load_weight=0.5)
    assert chosen == 1


def test_long_prefix_match_outweighs_moderate_load():
    chosen = route_prefix(loads((4, 0.4), IDLE), {0: 90}, RoutingRequest(100, 0), prefix_weight=1.0, load_weight=0.5)
    assert chosen == 0


def test_zero_prefix_weight_degenerates_to_least_load():
    chosen = route_prefix(loads((1, 0.1), IDLE), {0: 100}, RoutingRequest(100, 0), prefix_weight=0.0, load_weight=1.0)
    assert chosen == 1


def test_a_match_longer_than_the_prompt_counts_as_the_whole_prompt():
    # 200 tokens matched of a 100-token prompt is worth 100, not 200: the lighter rank with the same prompt wins.
    chosen = route_prefix(loads((2, 0.0), (1, 0.0)), {0: 200, 1: 100}, RoutingRequest(100, 0), prefix_weight=1.0,
                          load_weight=0.5)
    assert chosen == 1


def test_ties_rotate_with_the_request_counter_so_an_idle_cluster_spreads_work():
    policy = make_policy("prefix", prefix_weight=1.0, load_weight=0.5)
    chosen = [policy(loads(IDLE, IDLE, IDLE), {}, RoutingRequest(10, sequence)) for sequence in range(6)]
    assert chosen == [0, 1, 2, 0, 1, 2]


def test_choices_match_the_formula_scored_rank_by_rank():
    """Against the score written out per rank and a walk from the rotation's start (first highest wins)."""
    rng = random.Random(5)
    for _ in range(500):
        n = rng.randrange(1, 12)
        queue = [rng.randrange(4) for _ in range(n)]
        use = [rng.choice((0.0, 0.25, 0.5)) for _ in range(n)]
        matches = {p: rng.choice((16, 32, 200)) for p in rng.sample(range(n), rng.randrange(n + 1))}
        request = RoutingRequest(100, rng.randrange(1000))
        busiest = max(queue) or 1

        def score(p: int) -> float:
            load = 0.5 * queue[p] / busiest + 0.5 * use[p]
            return 1.0 * min(matches.get(p, 0), 100) / 100 - 0.5 * load

        start = request.sequence_number % n
        walk = [(start + k) % n for k in range(n)]
        best = max(score(p) for p in walk)
        expected = next(p for p in walk if abs(score(p) - best) < 1e-12)
        chosen = route_prefix(CandidateLoads(queue, use), matches, request, prefix_weight=1.0, load_weight=0.5)
        assert chosen == expected
