"""Expert parallelism: routed experts sharded over a torch.distributed group, tokens sent to their experts' owners.

Rank r holds experts [r * E/R, (r+1) * E/R). Each MoE layer does four all-to-alls: split sizes, token rows, expert
ids (dispatch), then expert outputs back (combine). The owner runs its received rows through the rank's own MoE
backend (grouped GEMM on the GPU, TorchMoE on the CPU) as one-expert tokens of weight 1. The origin rank applies the
routing weights and sums each token's experts in ascending expert id, the order TorchMoE uses, so float32 results
match one rank holding all.
Every rank must call forward the same number of times (an empty batch still joins each collective).
"""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdserve.ops.moe import MoEBackend, TorchMoE


@dataclass
class ExchangeStats:
    """Time and volume spent in the dispatch/combine collectives (cumulative)."""

    calls: int = 0
    seconds: float = 0.0
    sent_rows: int = 0


def expert_owner_range(rank: int, world_size: int, num_experts: int) -> tuple[int, int]:
    """[first, first + count) of the experts `rank` holds."""
    if num_experts % world_size:
        raise ValueError(f"{num_experts} routed experts do not split evenly over {world_size} ranks")
    count = num_experts // world_size
    return rank * count, count


class ExpertParallelMoE:
    """MoEBackend over `group`; `local` computes this rank's experts; `sync_timing` waits for the device around the
    exchange so its time is exact."""

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int, local: MoEBackend | None = None,
                 sync_timing: bool = False):
        self.group = group
        self.local = local or TorchMoE()
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.first_expert, self.experts_per_rank = expert_owner_range(self.rank, self.world_size, num_experts)
        self.sync_timing = sync_timing
        self.exchange = ExchangeStats()

    def forward(self, x, topk_ids, topk_weights, w13, w2, first_expert: int):
        if first_expert != self.first_expert or w13.shape[0] != self.experts_per_rank:
            raise ValueError(
                f"rank {self.rank} should hold experts [{self.first_expert}, +{self.experts_per_rank}), "
                f"the model holds [{first_expert}, +{w13.shape[0]})"
            )
        num_tokens, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        owner = torch.div(flat_ids, self.experts_per_rank, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)  # pairs grouped by owner; token order kept inside a group
        send_counts = torch.bincount(owner, minlength=self.world_size)
        send_x = x[torch.div(order, k, rounding_mode="floor")]
        send_ids = flat_ids[order]

        started = self._clock()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
        recv_x = x.new_empty(sum(recv_split), x.shape[1])
        recv_ids = send_ids.new_empty(sum(recv_split))
        dist.all_to_all_single(recv_x, send_x, recv_split, send_split, group=self.group)
        dist.all_to_all_single(recv_ids, send_ids, recv_split, send_split, group=self.group)
        dispatched = self._clock()

        # Each received row is a token with one expert of weight 1: the local backend returns its unweighted output.
        ones = torch.ones(recv_ids.shape[0], 1, dtype=torch.float32, device=x.device)
        expert_out = self.local.forward(recv_x, recv_ids[:, None], ones, w13, w2, self.first_expert) \
            if recv_ids.numel() else recv_x  # nothing came (empty rows): grouped GEMM has no empty case

        combine_started = self._clock()
        back = x.new_empty(send_x.shape)
        dist.all_to_all_single(back, expert_out, send_split, recv_split, group=self.group)
        finished = self._clock()
        self.exchange.calls += 1
        self.exchange.seconds += (dispatched - started) + (finished - combine_started)
        self.exchange.sent_rows += int(send_x.shape[0])

        per_pair = torch.empty_like(back)
        per_pair[order] = back
        return _combine(per_pair.view(num_tokens, k, x.shape[1]), topk_ids, topk_weights, x.dtype)

    def _clock(self) -> float:
        if self.sync_timing and torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()


def _combine(expert_out: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor:
    """Weighted sum over each token's k experts, added in ascending expert id from zero (TorchMoE's order)."""
    num_tokens, k, hidden = expert_out.shape
    slot_order = torch.argsort(topk_ids, dim=1, stable=True)
    rows = torch.arange(num_tokens, device=expert_out.device)[:, None]
    weighted = (expert_out * topk_weights[..., None]).to(dtype)[rows, slot_order]
    out = torch.zeros(num_tokens, hidden, dtype=dtype, device=expert_out.device)
    for slot in range(k):
        out += weighted[:, slot]
    return out
