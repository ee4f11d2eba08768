"""Routed experts as two grouped GEMMs (bf16 weights: pdserve.ops.gemm_triton's Triton kernel for decode-sized
batches, `torch._grouped_mm` above; block-FP8 weights: pdserve.ops.fp8_gemm's grouped FP8 GEMM): tokens sorted by
expert, no host syncs.

Each (token, slot) pair becomes one row; rows are sorted by local expert so every expert's rows are contiguous,
and the group boundaries come from the device (a search over the sorted ids, or counts), so the step never waits on
the host (a prerequisite for CUDA graphs). Rows that arrive in blocks already sorted by expert (the expert-parallel
exchange's) are placed by counting instead of sorted. Each row is scaled by its routing weight between the two GEMMs
(the down projection is linear, so this equals scaling its output), which leaves a plain sum of each token's slots
as the combine.
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
# GEMM, which reads each chosen expert's weights once in small tiles; larger ones to torch._grouped_mm (cuBLAS). On
# an H200 the Triton kernel ran 1.25-1.40x cuBLAS's speed at 24 and 48 rows and 0.94-0.98x at 96
# (benchmarks/gpu_grouped_gemm.py --tokens 256,512,1024).
SMALL_GROUPED_ROWS_PER_EXPERT = 64
COUNTING_SORT_MAX_ROWS = 96  # routed rows (16 tokens of V2-Lite's 6 slots): where the counting sort wins, see below
if importlib.util.find_spec("triton") is not None and torch.cuda.is_available():
    from pdserve.ops.gemm_triton import bf16_grouped_gemm_op, silu_and_mul_quantize
    from pdserve.ops.slot_sum_triton import sum_slot_rows_triton
else:
    bf16_grouped_gemm_op = silu_and_mul_quantize = sum_slot_rows_triton = None


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


def merge_sorted_blocks(ids: torch.Tensor, num_groups: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """sort_by_group for ids made of `blocks` equal blocks, each already sorted by group id: every row's place comes
    from counts of the groups in each block (a [blocks, groups] table), with no sort. Stable."""
    rows = ids.numel()
    index = torch.arange(rows, device=ids.device)
    block = torch.div(index, max(rows // blocks, 1), rounding_mode="floor")
    cell = block * num_groups + ids
    counts = torch.zeros(blocks * num_groups, dtype=torch.int64, device=ids.device) \
        .scatter_add_(0, cell, torch.ones_like(cell)).view(blocks, num_groups)
    totals = counts.sum(dim=0)
    group_ends = torch.cumsum(totals, dim=0)
    in_earlier_blocks = torch.cumsum(counts, dim=0) - counts  # rows of the group in the blocks before
    block_start = torch.cumsum(counts.view(-1), dim=0) - counts.view(-1)  # the cell's first row, as a row index
    inverse = (group_ends - totals)[ids] + in_earlier_blocks.view(-1)[cell] + index - block_start[cell]
    order = torch.empty_like(inverse)
    order[inverse] = index
    return order, inverse, group_ends.to(torch.int32)


def local_groups(ids: torch.Tensor, first_expert: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(group ids, is_local) of global expert ids: this rank's experts as 0..num_local-1, every other id (other ranks'
    experts, the exchange's padding -1) as num_local, a group past the last expert, which no GEMM computes."""
    local_ids = ids - first_expert
    is_local = (local_ids >= 0) & (local_ids < num_local)
    return torch.where(is_local, local_ids, num_local), is_local


class GroupedMoE:
    def forward(self, x, topk_ids, topk_weights, w13, w2, first_expert: int, local_slots: int | None = None):
        """`local_slots`: how many slots hold this rank's experts, where the caller knows it on the host (the
        expert-parallel exchange's received rows, about half of whose slots are other ranks'): only those slots then
        go through the activation, the GEMMs' rows and the sum. Either way the result is the same."""
        groups, is_local = local_groups(topk_ids.reshape(-1), first_expert, w13.shape[0])
        # Rows of the group past the last expert are left unset by the GEMMs.
        sorted_rows = sort_by_group(groups, w13.shape[0] + 1)
        return experts_of_sorted_rows(x, topk_ids.shape[1], topk_weights.reshape(-1), is_local, sorted_rows, w13, w2,
                                      local_slots=local_slots)

    def forward_blocks(self, x, ids, w13, w2, first_expert: int, blocks: int, expected_rows: int) -> torch.Tensor:
        """Each row of x through its expert `ids` (weight 1), where x and ids come as `blocks` equal blocks each
        sorted by expert, padding (id -1) last (the fixed-capacity exchange's received rows): placed by counting,
        no sort. `expected_rows`: how many rows are not padding, as a rule (the GEMMs' choice of kernel)."""
        groups, is_local = local_groups(ids, first_expert, w13.shape[0])
        sorted_rows = merge_sorted_blocks(groups, w13.shape[0] + 1, blocks)
        ones = torch.ones(ids.shape[0], dtype=torch.float32, device=x.device)
        return experts_of_sorted_rows(x, 1, ones, is_local, sorted_rows, w13, w2, expected_rows)


def experts_of_sorted_rows(x, top_k: int, weights: torch.Tensor, is_local: torch.Tensor,
                           sorted_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], w13, w2,
                           expected_rows: int | None = None, local_slots: int | None = None) -> torch.Tensor:
    """Each token's weighted sum of its k slots' experts, the slots (rows of token r // k) sorted by group as
    sort_by_group gives them; slots not is_local add nothing. `local_slots`: how many is_local slots there are, if
    known on the host (GroupedMoE.forward)."""
    order, inverse, group_ends = sorted_rows
    group_ends = group_ends[:-1]  # the last group holds the slots no GEMM computes
    if local_slots is not None:
        order = order[:local_slots]  # the local groups sort first
    gate_up = grouped_linear(x, w13, group_ends, row_index=order // top_k, expected_rows=expected_rows)
    down = activate_and_project_down(gate_up, weights[order], w2, group_ends, expected_rows)
    # Unsort (each slot's row: the inverse permutation) and combine; rows past the local groups are unset (they may
    # hold NaN), or past the end of `down` with the local slots counted.
    return sum_slot_rows(down, torch.where(is_local, inverse, -1), top_k)


def sum_slot_rows(rows: torch.Tensor, slot_row: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's sum over its k slots of rows[slot_row[s]], slots with slot_row -1 adding nothing: float32
    accumulation in slot order (deterministic, unlike an atomic scatter-add). On CUDA, eager: one Triton kernel."""
    fused = rows.is_cuda and sum_slot_rows_triton is not None and not torch.compiler.is_compiling()
    return (sum_slot_rows_triton if fused else sum_slot_rows_torch)(rows, slot_row, top_k)


def sum_slot_rows_torch(rows: torch.Tensor, slot_row: torch.Tensor, top_k: int) -> torch.Tensor:
    """sum_slot_rows in torch ops: a gather of every slot's row, a select, a sum over the slots."""
    gathered = rows[slot_row.clamp(min=0)]
    return torch.where((slot_row >= 0)[:, None], gathered, 0).view(-1, top_k, rows.shape[1]).sum(dim=1)


@dataclass(frozen=True)
class CompiledGroupedMoE:
    """GroupedMoE compiled whole by inductor for the decode graphs: the glue around its two grouped GEMMs (local ids,
    sort, group boundaries, row gathers, SiLU, the slot sum), ~14 small kernels a layer eagerly, fuses into a few."""

    forward: Callable

    @classmethod
    def build(cls, backend: str | Callable = "inductor") -> "CompiledGroupedMoE":
        return cls(compile_token_dynamic(GroupedMoE().forward, backend))


def activate_and_project_down(gate_up: torch.Tensor, weights: torch.Tensor, w2: torch.Tensor | BlockFP8Weight,
                              group_ends: torch.Tensor, expected_rows: int | None = None) -> torch.Tensor:
    """grouped_linear(weighted_silu_and_mul(gate_up, weights), w2, group_ends) for rows sorted by group."""
    # Inside a compiled region the plain function fuses with its neighbours anyway.
    fused = gate_up.is_cuda and not torch.compiler.is_compiling()
    if fused and silu_and_mul_quantize is not None and takes_quantized_sorted_rows(gate_up, w2):
        # The FP8 GEMM at prefill sizes would quantize the activations in a pass of its own: the activation writes
        # the FP8 rows and scales instead, and the bf16 activations (64 MB each way at V3's 16k rows) never exist.
        q, scales = silu_and_mul_quantize(gate_up, weights, w2.block_size[1])
        return block_fp8_grouped_linear_quantized(q, scales, w2, group_ends)
    activation = fused_weighted_silu_and_mul() if fused else weighted_silu_and_mul
    return grouped_linear(activation(gate_up, weights), w2, group_ends, expected_rows=expected_rows)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor | BlockFP8Weight, group_ends: torch.Tensor,
                   row_index: torch.Tensor | None = None, expected_rows: int | None = None) -> torch.Tensor:
    """Row i of the result: x[row_index[i]] (x[i] without an index) times the weight of the group holding row i.
    `expected_rows`: how many rows lie within the groups, as a rule (all of them by default): the bf16 kernel's
    choice."""
    if isinstance(weight, BlockFP8Weight):
        # gathers the rows as it quantizes them (prefill sizes) or inside the GEMM (decode sizes)
        return block_fp8_grouped_linear(x, weight, group_ends, row_index)
    rows = x.shape[0] if row_index is None else row_index.shape[0]
    expected_rows = rows if expected_rows is None else expected_rows
    if x.is_cuda and bf16_grouped_gemm_op is not None and \
            expected_rows <= SMALL_GROUPED_ROWS_PER_EXPERT * weight.shape[0]:
        return bf16_grouped_gemm_op(x, weight, group_ends, row_index)
    gathered = x if row_index is None else x[row_index]
    return torch._grouped_mm(gathered, weight.transpose(1, 2), offs=group_ends)
