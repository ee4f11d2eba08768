"""Replicas of the hottest experts, re-planned from the measured load every so many steps (redundant_experts)."""

import logging

import torch
import torch.distributed as dist

from pdserve.model.deepseek import DeepseekForCausalLM
from pdserve.ops.expert_load import ExpertLoad
from pdserve.ops.expert_placement import LayerPlacement
from pdserve.ops.moe_ep import ExpertParallelMoE

log = logging.getLogger(__name__)


class ExpertRebalancer:
    """Every `interval_steps` steps (every rank of the instance counts the same steps: they run in lockstep), the
    ranks add up the (token, expert) pairs each routed since the last rebalance and re-plan every MoE layer's replicas
    from them (LayerPlacement.rebalance). Collectives over the exchange's group."""

    def __init__(self, model: DeepseekForCausalLM, exchange: ExpertParallelMoE, spare: int, interval_steps: int):
        """Reserves `spare` replica slots in each MoE layer: once the weights are in, before graphs or the KV pool."""
        load = model.backends.expert_load
        if load is None:
            raise ValueError("redundant experts need the expert load counts")
        self.exchange = exchange
        self.load: ExpertLoad = load
        self.interval_steps = interval_steps
        self.placements: list[tuple[int, LayerPlacement]] = []
        for layer in model.model.layers:
            if not layer.is_moe:
                continue
            self.placements.append((layer.mlp.layer_idx, layer.mlp.experts.reserve_replica_slots(
                spare, exchange.rank, exchange.world_size)))
        self.counts_at_last = load.counts.clone()
        self.steps = 0
        self.slots_filled = 0  # replica slots that took a new expert, all ranks, since start

    def after_step(self) -> None:
        self.steps += 1
        if self.steps % self.interval_steps == 0:
            self.rebalance()

    @torch.inference_mode()
    def rebalance(self) -> None:
        counts = self.load.counts.clone()
        since_last = counts - self.counts_at_last
        self.counts_at_last = counts
        dist.all_reduce(since_last, group=self.exchange.group)
        loads = since_last.tolist()
        filled = sum(placement.rebalance(loads[layer], self.exchange.group) for layer, placement in self.placements)
        self.slots_filled += filled
        log.info("rank %d: experts rebalanced at step %d, %d replica slot(s) refilled", self.exchange.rank,
                 self.steps, filled)
