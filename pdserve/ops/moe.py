"""Routed-expert computation behind one seam: the torch reference here, grouped GEMM and expert parallelism elsewhere."""

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from pdserve.ops.block_fp8 import BlockFP8Weight
from pdserve.ops.fp8_gemm import block_fp8_linear_reference


@dataclass(frozen=True)
class ExpertRange:
    """The routed experts a rank holds: [first, first + count)."""

    first: int
    count: int


class MoEBackend(Protocol):
    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        topk_ids: torch.Tensor,  # [T, k] global expert ids
        topk_weights: torch.Tensor,  # [T, k] float32 routing weights (already scaled)
        w13: torch.Tensor | BlockFP8Weight,  # [local_experts, 2 * inter, hidden] gate and up stacked
        w2: torch.Tensor | BlockFP8Weight,  # [local_experts, hidden, inter]
        first_expert: int,  # global id of local expert 0
    ) -> torch.Tensor:  # [T, hidden]
        ...


class TorchMoE:
    """Reference: one matmul pair per expert that has tokens, summed in expert order."""

    def forward(self, x, topk_ids, topk_weights, w13, w2, first_expert: int):
        out = torch.zeros_like(x)
        local_ids = topk_ids - first_expert
        for expert in torch.unique(local_ids).tolist():
            if not 0 <= expert < w13.shape[0]:
                continue
            token_idx, slot = torch.where(local_ids == expert)
            gate, up = _expert_linear(x[token_idx], w13[expert]).chunk(2, dim=-1)
            y = _expert_linear(F.silu(gate) * up, w2[expert]) * topk_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def _expert_linear(x: torch.Tensor, weight: torch.Tensor | BlockFP8Weight) -> torch.Tensor:
    if isinstance(weight, BlockFP8Weight):
        return block_fp8_linear_reference(x, weight)  # the reference dequantizes, on any device
    return F.linear(x, weight)
