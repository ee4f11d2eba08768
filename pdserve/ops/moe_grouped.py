"""Routed experts as two grouped GEMMs (bf16 weights: pdserve.ops.gemm_triton's Triton kernel for decode-sized
batches, `torch._grouped_mm` above; block-FP8 weights: pdserve.ops.fp8_gemm's grouped FP8 GEMM): tokens sorted by
expert, no host syncs.

Each (token, slot) pair becomes one row; rows are sorted by local expert so every expert's rows are contiguous,
and the group boundaries come from a device-side search over the sorted ids, so the step never waits on the host
(a prerequisite for CUDA graphs). Each row is scaled by its routing weight between the two GEMMs (the down
projection is linear, so this equals scaling its output), which leaves a plain sum of each token's slots as the
combine.
"""

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.ops.block_fp8 import BlockFP8Weight
from pdserve.ops.fp8_gemm import (
    block_fp8_grouped_linear,
    block_fp8_grouped_linear_quantized,
    takes_quantized_sorted_rows,
)
from pdserve.ops.token_dynamic import compile_token_dynamic

# Decode-sized expert batches (up to this many routed rows per local expert on average) go to the Triton grouped
# GEMM, which reads each chosen expert's weights once in small tiles; larger ones to torch._grouped_mm (cuBLAS).
SMALL_GROUPED_ROWS_PER_EXPERT = 32
COUNTING_SORT_MAX_ROWS = 96  # routed rows (16 tokens of V2-Lite's 6 slots): where the counting sort wins, see below
if importlib.util.find_spec("triton") is not None and torch.cuda.is_available():
    from pdserve.ops.gemm_triton import bf16_grouped_gemm_op, silu_and_mul_quantize
else:
    bf16_grouped_gemm_op = silu_and_mul_quantize = None


def weighted_silu_and_mul(gate_up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up * routing weight for each row [N, 2 * inter] -> [N, inter]: computed in float32, rounded once.
    (A weight rounded to bf16 would bias the whole slot: one bf16 weight raised the V2-Lite logits error from 4.8e-2
    to 5.6e-2.)"""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up * weights[:, None]).to(gate_up.dtype)


@functools.cache
def fused_weighted_silu_and_mul() -> Callable:
    """On CUDA weighted_silu_and_mul compiled into one kernel (a single pass over gate_up), where eager torch makes
    five passes with float32 temporaries. Compiled on first use, once for all row counts, in this process: the
    default pool of compile workers leaves a thread behind that slowed every later host step ~5x (a flashinfer plan
    1.6 -> 8 ms, measured on an H100 host). Built on first call too: torch.compile imports dynamo and inductor, ~2 s
    of every process start that imports the experts (each worker and rank), where the CPU never compiles."""
    return torch.compile(weighted_silu_and_mul, dynamic=True, options={"compile_threads": 1})


def sort_by_group(ids: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows sorted by group id in [0, num_groups): (order, inverse, group_ends). `order` lists the rows group after
    group; `inverse[r]` is row r's place in it; `group_ends` int32, each group's cumulative row end.

    Compiled and at most COUNTING_SORT_MAX_ROWS rows (small decode batches), a counting sort; else a radix sort.
    On an H100, compiled and replayed in a graph (benchmarks/gpu_grouped_gemm.py --sort): 6 rows 4.5 against 10.5
    us, 96 rows 12.1 against 16.1, 384 rows 36.3 against 33.4, 1,536 rows 135 against 36 (inductor scans the rows
    one after another). Eagerly the counting sort is ~9 launches against one. The size test makes the compiled
    experts two graphs, one each side of the limit."""
    if torch.compiler.is_compiling() and ids.numel() <= COUNTING_SORT_MAX_ROWS:
        return counting_sort(ids, num_groups)
    return radix_sort(ids, num_groups)


def counting_sort(ids: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sort_by_group by counts: elementwise passes and one scan over [rows, groups] (stable)."""
    member = (ids[:, None] == torch.arange(num_groups, device=ids.device)).to(torch.int32)
    seen = torch.cumsum(member, dim=0, dtype=torch.int32)  # rows of each group up to and including this one
    counts = member.sum(dim=0, dtype=torch.int32)  # (not seen[-1]: there may be no rows)
    group_ends = torch.cumsum(counts, dim=0, dtype=torch.int32)
    inverse = (group_ends - counts)[ids] + (seen * member).sum(dim=1) - 1
    order = torch.empty_like(inverse)
    order[inverse] = torch.arange(ids.numel(), device=ids.device, dtype=inverse.dtype)
    return order, inverse, group_ends


def radix_sort(ids: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sort_by_group by torch.sort, group ends by a search of the sorted ids."""
    sorted_ids, order = torch.sort(ids)
    boundaries = torch.arange(1, num_groups + 1, device=ids.device, dtype=sorted_ids.dtype)
    group_ends = torch.searchsorted(sorted_ids, boundaries, right=False).to(torch.int32)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return order, inverse, group_ends


class GroupedMoE:
    def forward(self, x, topk_ids, topk_weights, w13, w2, first_expert: int):
        num_tokens, top_k = topk_ids.shape
        num_local = w13.shape[0]
        local_ids = (topk_ids - first_expert).reshape(-1)
        is_local = (local_ids >= 0) & (local_ids < num_local)
        # Slots of other ranks' experts (half the rows of the fixed-capacity exchange are such padding) sort into a
        # group past the last expert, which no GEMM computes: rows past the last group end are left unset.
        order, inverse, group_ends = sort_by_group(torch.where(is_local, local_ids, num_local), num_local + 1)
        group_ends = group_ends[:-1]
        gate_up = grouped_linear(x, w13, group_ends, row_index=order // top_k)
        down = activate_and_project_down(gate_up, topk_weights.reshape(-1)[order], w2, group_ends)
        # Unsort with a gather (the inverse permutation), unset rows read as zero (a select: they may hold NaN), then
        # sum each token's k slots (float32 accumulation, deterministic, unlike an atomic scatter-add).
        per_slot = torch.where(is_local[:, None], down[inverse], 0)
        return per_slot.view(num_tokens, top_k, -1).sum(dim=1)


@dataclass(frozen=True)
class CompiledGroupedMoE:
    """GroupedMoE compiled whole by inductor for the decode graphs: the glue around its two grouped GEMMs (local ids,
    sort, group boundaries, row gathers, SiLU, the slot sum), ~14 small kernels a layer eagerly, fuses into a few."""

    forward: Callable

    @classmethod
    def build(cls, backend: str | Callable = "inductor") -> "CompiledGroupedMoE":
        return cls(compile_token_dynamic(GroupedMoE().forward, backend))


def activate_and_project_down(gate_up: torch.Tensor, weights: torch.Tensor, w2: torch.Tensor | BlockFP8Weight,
                              group_ends: torch.Tensor) -> torch.Tensor:
    """grouped_linear(weighted_silu_and_mul(gate_up, weights), w2, group_ends) for rows sorted by group."""
    # Inside a compiled region the plain function fuses with its neighbours anyway.
    fused = gate_up.is_cuda and not torch.compiler.is_compiling()
    if fused and silu_and_mul_quantize is not None and takes_quantized_sorted_rows(gate_up, w2):
        # The FP8 GEMM at prefill sizes would quantize the activations in a pass of its own: the activation writes
        # the FP8 rows and scales instead, and the bf16 activations (64 MB each way at V3's 16k rows) never exist.
        q, scales = silu_and_mul_quantize(gate_up, weights, w2.block_size[1])
        return block_fp8_grouped_linear_quantized(q, scales, w2, group_ends)
    activation = fused_weighted_silu_and_mul() if fused else weighted_silu_and_mul
    return grouped_linear(activation(gate_up, weights), w2, group_ends)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor | BlockFP8Weight, group_ends: torch.Tensor,
                   row_index: torch.Tensor | None = None) -> torch.Tensor:
    """Row i of the result: x[row_index[i]] (x[i] without an index) times the weight of the group holding row i."""
    if isinstance(weight, BlockFP8Weight):
        # gathers the rows as it quantizes them (prefill sizes) or inside the GEMM (decode sizes)
        return block_fp8_grouped_linear(x, weight, group_ends, row_index)
    rows = x.shape[0] if row_index is None else row_index.shape[0]
    if x.is_cuda and bf16_grouped_gemm_op is not None and rows <= SMALL_GROUPED_ROWS_PER_EXPERT * weight.shape[0]:
        return bf16_grouped_gemm_op(x, weight, group_ends, row_index)
    gathered = x if row_index is None else x[row_index]
    return torch._grouped_mm(gathered, weight.transpose(1, 2), offs=group_ends)
