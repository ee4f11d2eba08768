"""Routed experts as two grouped GEMMs (bf16 weights: pdserve.ops.gemm_triton's Triton kernel for decode-sized
batches, `torch._grouped_mm` above; block-FP8 weights: pdserve.ops.fp8_gemm's grouped FP8 GEMM): tokens sorted by
expert, no host syncs.

Each (token, slot) pair becomes one row; rows are sorted by local expert so every expert's rows are contiguous,
and the group boundaries come from a device-side search over the sorted ids, so the step never waits on the host
(a prerequisite for CUDA graphs). Each row is scaled by its routing weight between the two GEMMs (the down
projection is linear, so this equals scaling its output), which leaves a plain sum of each token's slots as the
combine.
"""

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.ops.block_fp8 import BlockFP8Weight
from pdserve.ops.fp8_gemm import block_fp8_grouped_linear
from pdserve.ops.token_dynamic import compile_token_dynamic

# Decode-sized expert batches (up to this many routed rows per local expert on average) go to the Triton grouped
# GEMM, which reads each chosen expert's weights once in small tiles; larger ones to torch._grouped_mm (cuBLAS).
SMALL_GROUPED_ROWS_PER_EXPERT = 32
if importlib.util.find_spec("triton") is not None and torch.cuda.is_available():
    from pdserve.ops.gemm_triton import bf16_grouped_gemm_op
else:
    bf16_grouped_gemm_op = None


def weighted_silu_and_mul(gate_up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up * routing weight for each row [N, 2 * inter] -> [N, inter]: computed in float32, rounded once.
    (A weight rounded to bf16 would bias the whole slot: one bf16 weight raised the V2-Lite logits error from 4.8e-2
    to 5.6e-2.)"""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up * weights[:, None]).to(gate_up.dtype)


# On CUDA the same function compiled into one kernel (a single pass over gate_up), where eager torch makes five
# passes with float32 temporaries. Compiled lazily, on first use, once for all row counts, in this process: the
# default pool of compile workers leaves a thread behind that slowed every later host step ~5x (a flashinfer plan
# 1.6 -> 8 ms, measured on an H100 host).
fused_weighted_silu_and_mul = torch.compile(weighted_silu_and_mul, dynamic=True, options={"compile_threads": 1})


class GroupedMoE:
    def forward(self, x, topk_ids, topk_weights, w13, w2, first_expert: int):
        num_tokens, top_k = topk_ids.shape
        num_local = w13.shape[0]
        local_ids = (topk_ids - first_expert).reshape(-1)
        is_local = (local_ids >= 0) & (local_ids < num_local)
        # Slots routed to another rank's experts ride along with local expert 0 at weight 0: computed (so finite)
        # and adding nothing. The expert-parallel layer only ever passes local slots, so this costs nothing there.
        local_ids = torch.where(is_local, local_ids, 0)
        weights = torch.where(is_local, topk_weights.reshape(-1), 0.0)
        sorted_ids, order = torch.sort(local_ids)
        boundaries = torch.arange(1, num_local + 1, device=x.device, dtype=sorted_ids.dtype)
        group_ends = torch.searchsorted(sorted_ids, boundaries, right=False).to(torch.int32)
        gate_up = grouped_linear(x, w13, group_ends, row_index=order // top_k)
        # Inside a compiled region the plain function fuses with its neighbours anyway.
        fused = x.is_cuda and not torch.compiler.is_compiling()
        activation = fused_weighted_silu_and_mul if fused else weighted_silu_and_mul
        activations = activation(gate_up, weights[order])
        down = grouped_linear(activations, w2, group_ends)
        # Unsort with a gather (the inverse permutation), then sum each token's k slots (float32 accumulation,
        # deterministic, unlike an atomic scatter-add).
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return down[inverse].view(num_tokens, top_k, -1).sum(dim=1)


@dataclass(frozen=True)
class CompiledGroupedMoE:
    """GroupedMoE compiled whole by inductor for the decode graphs: the glue around its two grouped GEMMs (local ids,
    sort, group boundaries, row gathers, SiLU, the slot sum), ~14 small kernels a layer eagerly, fuses into a few."""

    forward: Callable

    @classmethod
    def build(cls, backend: str | Callable = "inductor") -> "CompiledGroupedMoE":
        return cls(compile_token_dynamic(GroupedMoE().forward, backend))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor | BlockFP8Weight, group_ends: torch.Tensor,
                   row_index: torch.Tensor | None = None) -> torch.Tensor:
    """Row i of the result: x[row_index[i]] (x[i] without an index) times the weight of the group holding row i."""
    if isinstance(weight, BlockFP8Weight):
        return block_fp8_grouped_linear(x, weight, group_ends, row_index)  # gathers the rows inside the GEMM
    rows = x.shape[0] if row_index is None else row_index.shape[0]
    if x.is_cuda and bf16_grouped_gemm_op is not None and rows <= SMALL_GROUPED_ROWS_PER_EXPERT * weight.shape[0]:
        return bf16_grouped_gemm_op(x, weight, group_ends, row_index)
    gathered = x if row_index is None else x[row_index]
    return torch._grouped_mm(gathered, weight.transpose(1, 2), offs=group_ends)
