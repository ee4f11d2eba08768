"""Routed experts as two grouped GEMMs (`torch._grouped_mm`, bf16): tokens sorted by expert, no host syncs.

Each (token, slot) pair becomes one row; rows are sorted by local expert so every expert's rows are contiguous,
and the group boundaries come from a device-side search over the sorted ids, so the step never waits on the host
(a prerequisite for CUDA graphs). Slots routed to another rank's experts sort last, past the final group
boundary, and are dropped in the combine.
"""

import torch
import torch.nn.functional as F


class GroupedMoE:
    def forward(self, x, topk_ids, topk_weights, w13, w2, first_expert: int):
        num_tokens, top_k = topk_ids.shape
        num_local = w13.shape[0]
        local_ids = (topk_ids - first_expert).reshape(-1)
        is_local = (local_ids >= 0) & (local_ids < num_local)
        local_ids = torch.where(is_local, local_ids, num_local)  # foreign slots form a trailing bucket
        sorted_ids, order = torch.sort(local_ids)
        boundaries = torch.arange(1, num_local + 1, device=x.device, dtype=sorted_ids.dtype)
        group_ends = torch.searchsorted(sorted_ids, boundaries, right=False).to(torch.int32)
        rows = x[order // top_k]
        gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=group_ends)
        gate, up = gate_up.chunk(2, dim=-1)
        down = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=group_ends)
        # Rows past the last group end are never written by the kernel: zero them rather than trust their contents.
        weights = torch.where(is_local, topk_weights.reshape(-1), 0.0)[order]
        contribution = torch.where(weights[:, None] != 0, down.float() * weights[:, None], 0.0)
        # Unsort, then sum each token's k slots: deterministic, unlike an atomic scatter-add.
        per_slot = torch.empty_like(contribution)
        per_slot[order] = contribution
        return per_slot.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
