"""Planning replicas of hot experts (host only; the exchange over them is in test_moe_ep.py, the engine's rebalances
in tests/engine/test_lockstep.py)."""

import random

from pdserve.ops.expert_placement import plan_replicas


def rank_loads(load: list[float], world_size: int, replicas: list[list[int]]) -> list[float]:
    """Each rank's load once every expert's load is split evenly over its holders."""
    per_rank = len(load) // world_size
    holders = {e: [e // per_rank] + [r for r in range(world_size) if e in replicas[r]] for e in range(len(load))}
    loads = [0.0] * world_size
    for expert, ranks in holders.items():
        for rank in ranks:
            loads[rank] += load[expert] / len(ranks)
    return loads


def test_an_even_load_places_no_replica():
    assert plan_replicas([5.0] * 16, 4, 2) == [[], [], [], []]
    assert plan_replicas([0.0] * 16, 4, 2) == [[], [], [], []]  # no load measured yet


def test_one_hot_expert_is_spread_over_every_rank():
    load = [1.0] * 8
    load[1] = 30.0  # rank 0's second expert
    replicas = plan_replicas(load, 4, 1)
    assert replicas[1:] == [[1], [1], [1]]  # rank 0's slot then takes what lowers the peak further
    assert max(rank_loads(load, 4, replicas)) < max(rank_loads(load, 4, [[]] * 4)) / 3


def test_replicas_are_other_ranks_experts_within_the_spare_slots_and_lower_the_peak():
    gen = random.Random(5)
    for _ in range(50):
        world_size, per_rank, spare = gen.choice([2, 4, 8]), gen.choice([2, 4, 8]), gen.choice([1, 2, 3])
        load = [gen.expovariate(1.0) * (6 if gen.random() < 0.1 else 1) for _ in range(world_size * per_rank)]
        replicas = plan_replicas(load, world_size, spare)
        assert replicas == plan_replicas(list(load), world_size, spare)  # every rank plans the same
        for rank, experts in enumerate(replicas):
            assert len(experts) <= spare and len(set(experts)) == len(experts)
            assert all(e // per_rank != rank for e in experts)
        assert max(rank_loads(load, world_size, replicas)) <= max(rank_loads(load, world_size, [[]] * world_size))
