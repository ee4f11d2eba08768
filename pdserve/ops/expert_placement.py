"""Hot experts replicated on other ranks (redundant experts, as DeepSeek's EPLB): each rank keeps `spare` expert slots
a MoE layer after its own experts, and a rebalance fills them with copies of the experts the measured load says are
hottest, so that a rank whose experts win more pairs than its share hands some to a replica.

A replicated expert's pairs alternate between its holders by token. Only the exchange with split sizes (prefill
steps) reads the placement: the fixed-capacity exchange of the decode graphs keeps each pair with its owner, where an
uneven load measured 3% of a step (docs/benchmarks.md).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


def plan_replicas(load: list[float], world_size: int, spare: int) -> list[list[int]]:
    """The experts each rank should replicate (at most `spare` each, none of its own): greedily, the expert with the
    largest load per holder on the most loaded rank gets a replica on the least loaded rank that can take it, as long
    as that lowers the most loaded rank's load. A holder's load counts an expert's load split evenly over its holders.
    The same `load` gives the same plan on every rank."""
    per_rank = len(load) // world_size
    holders = [[expert // per_rank] for expert in range(len(load))]
    rank_load = [sum(load[r * per_rank:(r + 1) * per_rank]) for r in range(world_size)]
    replicas: list[list[int]] = [[] for _ in range(world_size)]
    while True:
        hot = max(range(world_size), key=lambda r: (rank_load[r], -r))
        placed = False
        for expert in sorted((e for e in range(len(load)) if hot in holders[e]),
                             key=lambda e: (-load[e] / len(holders[e]), e)):
            share = load[expert] / (len(holders[expert]) + 1)
            takers = [r for r in range(world_size) if r not in holders[expert] and len(replicas[r]) < spare
                      and rank_load[r] + share < rank_load[hot]]
            if not takers or share <= 0:
                continue
            taker = min(takers, key=lambda r: (rank_load[r], r))
            for holder in holders[expert]:
                rank_load[holder] -= load[expert] / len(holders[expert]) - share
            rank_load[taker] += share
            holders[expert].append(taker)
            replicas[taker].append(expert)
            placed = True
            break
        if not placed:
            return replicas


@dataclass
class LayerPlacement:
    """One MoE layer's placement on one rank, on the device; a rebalance rewrites it in place.

    `slots` are the rank's expert tensors (w13 and w2; FP8 experts also their scale grids), each with its own experts
    first (the model's parameters become views of them), then `spare` replicas. `weights` is what the MoE backend
    computes with, made of the slots by the module that owns them (plain tensors, or BlockFP8Weight)."""

    rank: int
    world_size: int
    per_rank: int  # experts each rank owns
    slots: tuple[torch.Tensor, ...]  # each [per_rank + spare, ...]
    holders: torch.Tensor  # [E, R] int64: the ranks holding each expert, its owner first; past holder_count: the owner
    holder_count: torch.Tensor  # [E] int64
    slot_of: torch.Tensor  # [R, E] int64: the expert's slot on that rank, -1 where the rank does not hold it
    replicas: list[list[int]]  # per rank: the experts in its spare slots, in slot order (host copy of the plan)
    weights: tuple = ()  # (w13, w2) over the slots, for the backend: set by the slots' owner

    @classmethod
    def own_experts(cls, tensors: tuple[torch.Tensor, ...], spare: int, rank: int,
                    world_size: int) -> "LayerPlacement":
        """Slots for `spare` replicas after this rank's own experts (`tensors`, each [own experts, ...]), none
        placed yet; slots[i][:own] holds tensors[i] (the caller points its parameters at them)."""
        per_rank, device = tensors[0].shape[0], tensors[0].device
        slots = tuple(t.new_empty(per_rank + spare, *t.shape[1:]) for t in tensors)
        for slot, own in zip(slots, tensors):
            slot[:per_rank].copy_(own)
        num_experts = per_rank * world_size
        owner = torch.arange(num_experts, device=device) // per_rank
        placement = cls(rank, world_size, per_rank, slots, owner[:, None].repeat(1, world_size).contiguous(),
                        torch.ones(num_experts, dtype=torch.int64, device=device),
                        torch.full((world_size, num_experts), -1, dtype=torch.int64, device=device),
                        [[] for _ in range(world_size)])
        placement._write_tables()
        return placement

    @property
    def spare(self) -> int:
        return self.slots[0].shape[0] - self.per_rank

    def pair_ranks(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, k]: the rank that computes each (token, expert) pair; a replicated expert's pairs alternate between its
        holders by token."""
        token = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]
        return self.holders[topk_ids, token % self.holder_count[topk_ids]]

    def slots_at(self, owner: torch.Tensor, topk_ids: torch.Tensor, pair_rank: torch.Tensor) -> torch.Tensor:
        """Rows sent to `owner` [N] with their tokens' expert ids [N, k] and pair ranks [N, k]: each id as its slot on
        that owner where the owner computes the pair, else -1."""
        return torch.where(pair_rank == owner[:, None], self.slot_of[owner[:, None], topk_ids], -1)

    def rebalance(self, load: list[float], group: dist.ProcessGroup | None = None) -> int:
        """A collective: plan replicas from `load` (every rank the same values) and copy the experts whose slot changed
        from their owners. Returns how many slots (all ranks) took a new expert."""
        plan = plan_replicas(load, self.world_size, self.spare)
        changed = [[(slot, expert) for slot, expert in enumerate(experts)
                    if slot >= len(self.replicas[r]) or self.replicas[r][slot] != expert] for r, experts in
                   enumerate(plan)]
        # Each rank sends its own experts that another rank's changed slots take, in (rank, slot) order.
        sends = [[expert - self.rank * self.per_rank for _, expert in changed[r] if expert // self.per_rank == self.rank]
                 for r in range(self.world_size)]
        receives = [[slot for slot, expert in changed[self.rank] if expert // self.per_rank == r]
                    for r in range(self.world_size)]
        sent = [e for row in sends for e in row]
        for slots in self.slots:
            # as bytes (gloo moves no FP8); slots[:0] when nothing goes: an empty index's result has 0 strides
            send = (slots[sent] if sent else slots[:0]).view(torch.uint8)
            recv = send.new_empty(sum(map(len, receives)), *send.shape[1:])
            dist.all_to_all_single(recv, send, [len(r) for r in receives], [len(s) for s in sends], group=group)
            for row, slot in enumerate(s for r in receives for s in r):
                slots[self.per_rank + slot].copy_(recv[row].view(slots.dtype))
        self.replicas = plan
        self._write_tables()
        return sum(map(len, changed))

    def _write_tables(self) -> None:
        """holders, holder_count and slot_of from `replicas`, written in place (a captured graph keeps them)."""
        num_experts = self.per_rank * self.world_size
        holders = [[expert // self.per_rank] for expert in range(num_experts)]
        slot_of = [[-1] * num_experts for _ in range(self.world_size)]
        for rank in range(self.world_size):
            for local in range(self.per_rank):
                slot_of[rank][rank * self.per_rank + local] = local
            for slot, expert in enumerate(self.replicas[rank]):
                holders[expert].append(rank)
                slot_of[rank][expert] = self.per_rank + slot
        device = self.holders.device
        self.holder_count.copy_(torch.tensor([len(h) for h in holders], device=device))
        self.holders.copy_(torch.tensor([h + [h[0]] * (self.world_size - len(h)) for h in holders], device=device))
        self.slot_of.copy_(torch.tensor(slot_of, device=device))


def reserve_replica_slots(module: torch.nn.Module, names: tuple[str, ...], spare: int, rank: int,
                          world_size: int) -> LayerPlacement:
    """A placement whose slots hold `module`'s per-expert parameters `names` (its own experts, first) and `spare`
    replicas; the parameters become views of the slots, so whatever holds their addresses (a CUDA graph) is not
    moved by a rebalance. Once the weights are in."""
    placement = LayerPlacement.own_experts(tuple(getattr(module, name).detach() for name in names), spare, rank,
                                           world_size)
    for name, slots in zip(names, placement.slots):
        setattr(module, name, torch.nn.Parameter(slots[:placement.per_rank], requires_grad=False))
    return placement

