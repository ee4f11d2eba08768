"""Triton kernels on CUDA: activation quantization in 1 x 128 groups (alone, or fused with the routed experts'
weighted SiLU-and-mul, which then never writes its bf16 output), and one GEMM over groups of rows (a single
group: a dense linear; one group per expert: routed experts over rows sorted by expert), block-FP8 or bf16.

The GEMM walks K one block at a time: each step is a tensor-core product of a [rows, BLOCK_K] activation tile and a
[BLOCK_K, cols] weight tile, accumulated in float32; in FP8 after multiplying by the rows' activation scales and the
columns' weight-block scales (the scales change along K, so they cannot wait for the epilogue). The bf16 form serves
decode-sized expert batches, a few rows per expert, where the GEMM is a read of the chosen experts' weights.

Two kernels: one loads its tiles through pointers and can gather each row by index (any GPU, any shape); the other,
for block-FP8 experts at prefill sizes on Hopper, takes rows already gathered and sorted by expert and loads both
operands with TMA descriptors (quantize_rows() gathers the rows as it quantizes them; the down projection's rows,
sorted already, come from silu_and_mul_quantize()).
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pdserve.ops.block_fp8 import FP8_DTYPE, FP8_MAX, BlockFP8Weight

QUANTIZE_ROWS_PER_PROGRAM = 32
SWIZZLE_M = 8  # m-tiles walked down one column of n-tiles before moving right: neighbours share weight tiles in L2
BF16_BLOCK_K = 64


@triton.jit
def _store_quantized(x, r, c, q_ptr, scale_ptr, padded_rows, cols, scale_group_stride, FP8_LIMIT: tl.constexpr):
    """x [rows r, columns c] float32, one group of columns (program_id(1)) -> its FP8 codes and one scale per row."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax / FP8_LIMIT, 1.0)  # a zero group: any positive scale is exact
    q = tl.minimum(tl.maximum(x / scale[:, None], -FP8_LIMIT), FP8_LIMIT)
    in_buffer = r < padded_rows  # padding rows are written as zeros of scale 1
    tl.store(q_ptr + r[:, None].to(tl.int64) * cols + c[None, :], q.to(q_ptr.dtype.element_ty),
             mask=in_buffer[:, None] & (c < cols)[None, :])
    tl.store(scale_ptr + tl.program_id(1) * scale_group_stride + r, scale, mask=in_buffer)


# Row counts change with every batch: `do_not_specialize` keeps Triton from compiling a variant per their divisibility.
@triton.jit(do_not_specialize=["rows", "padded_rows"])
def _quantize_rows_kernel(x_ptr, row_index_ptr, q_ptr, scale_ptr, rows, padded_rows, cols, x_row_stride,
                          scale_group_stride, GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, FP8_LIMIT: tl.constexpr,
                          GATHER: tl.constexpr):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    row_ok = r < rows
    if GATHER:
        source = tl.load(row_index_ptr + r, mask=row_ok, other=0).to(tl.int64)
    else:
        source = r.to(tl.int64)
    x = tl.load(x_ptr + source[:, None] * x_row_stride + c[None, :],
                mask=row_ok[:, None] & (c < cols)[None, :], other=0.0).to(tl.float32)
    _store_quantized(x, r, c, q_ptr, scale_ptr, padded_rows, cols, scale_group_stride, FP8_LIMIT)


@triton.jit(do_not_specialize=["rows", "padded_rows"])
def _silu_and_mul_quantize_kernel(gate_up_ptr, weight_ptr, q_ptr, scale_ptr, rows, padded_rows, inter,
                                  gate_up_row_stride, scale_group_stride, GROUP: tl.constexpr,
                                  BLOCK_ROWS: tl.constexpr, FP8_LIMIT: tl.constexpr):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    row_ok = r < rows
    mask = row_ok[:, None] & (c < inter)[None, :]
    gate_ptrs = gate_up_ptr + r[:, None].to(tl.int64) * gate_up_row_stride + c[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + r, mask=row_ok, other=0.0).to(tl.float32)
    # torch's order of operations (F.silu(gate) * up * weight), so only exp's rounding can differ from it
    x = gate / (1.0 + tl.exp(-gate)) * up * weight[:, None]
    _store_quantized(x, r, c, q_ptr, scale_ptr, padded_rows, inter, scale_group_stride, FP8_LIMIT)


def _quantized_rows_buffers(rows: int, cols: int, group: int, pad_rows_to: int,
                            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (FP8 [M', cols], float32 scales [ceil(cols / group), M']) for `rows` rows, M' = rows rounded up to
    `pad_rows_to`: the layout quantize_rows() documents."""
    padded_rows = -(-rows // pad_rows_to) * pad_rows_to
    q = torch.empty(padded_rows, cols, dtype=FP8_DTYPE, device=device)
    return q, torch.empty(-(-cols // group), padded_rows, dtype=torch.float32, device=device)


def quantize_rows(x: torch.Tensor, group: int, pad_rows_to: int = 1,
                  row_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M', K], float32 scales [ceil(K / group), M']): one scale per row per `group` columns, the
    group's largest magnitude mapped to the FP8 maximum. M' is M rounded up to `pad_rows_to`. Scales are stored
    group-major, which is both what cuBLAS takes for 1 x 128 scaling and a contiguous load for a tile of rows.
    With `row_index`, row i of the result is x[row_index[i]] quantized (M = row_index's length)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = (x.shape[0] if row_index is None else row_index.numel()), x.shape[1]
    q, scales = _quantized_rows_buffers(rows, cols, group, pad_rows_to, x.device)
    if q.numel():
        grid = (triton.cdiv(q.shape[0], QUANTIZE_ROWS_PER_PROGRAM), scales.shape[0])
        _quantize_rows_kernel[grid](x, row_index if row_index is not None else x, q, scales, rows, q.shape[0], cols,
                                    x.stride(0), scales.stride(0), GROUP=group, BLOCK_ROWS=QUANTIZE_ROWS_PER_PROGRAM,
                                    FP8_LIMIT=FP8_MAX, GATHER=row_index is not None)
    return q, scales


def silu_and_mul_quantize(gate_up: torch.Tensor, weights: torch.Tensor, group: int,
                          pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2 * inter] and per-row weights [M] -> quantize_rows() of SiLU(gate) * up * weight computed in
    float32 (the routed experts' activation, pdserve.ops.moe_grouped), in one pass: the activations are never
    written in bf16 and read back to be quantized."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if weights.shape != (rows,):
        raise ValueError(f"one routing weight per row of gate_up {tuple(gate_up.shape)}, got {tuple(weights.shape)}")
    weights = weights.contiguous()
    q, scales = _quantized_rows_buffers(rows, inter, group, pad_rows_to, gate_up.device)
    if q.numel():
        grid = (triton.cdiv(q.shape[0], QUANTIZE_ROWS_PER_PROGRAM), scales.shape[0])
        _silu_and_mul_quantize_kernel[grid](gate_up, weights, q, scales, rows, q.shape[0], inter, gate_up.stride(0),
                                            scales.stride(0), GROUP=group, BLOCK_ROWS=QUANTIZE_ROWS_PER_PROGRAM,
                                            FP8_LIMIT=FP8_MAX)
    return q, scales


@triton.jit
def _swizzled_tile(m_tiles, n, BLOCK_N: tl.constexpr, SWIZZLE: tl.constexpr):
    """This program's (m-tile, n-tile): SWIZZLE m-tiles walked down one column of n-tiles before moving right."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n, BLOCK_N)
    band = pid // (SWIZZLE * n_tiles)
    band_height = tl.minimum(m_tiles - band * SWIZZLE, SWIZZLE)
    in_band = pid % (SWIZZLE * n_tiles)
    return band * SWIZZLE + in_band % band_height, in_band // band_height


@triton.jit
def _group_of_tile(m_tile, group_ends_ptr, num_groups, GROUPS_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(group, first row, the group's row end) of an m-tile; group == num_groups for a spare program. m-tiles are
    numbered group after group (each group's rows split into ceil(rows / BLOCK_M) tiles); the launch has room for the
    most tiles any split of the rows can need."""
    g = tl.arange(0, GROUPS_POW2)
    ends = tl.load(group_ends_ptr + g, mask=g < num_groups, other=0)
    starts = tl.load(group_ends_ptr + g - 1, mask=(g > 0) & (g < num_groups), other=0)
    tiles = tl.cdiv(ends - starts, BLOCK_M)
    tile_ends = tl.cumsum(tiles, axis=0)
    group = tl.sum((tile_ends <= m_tile).to(tl.int32), axis=0)
    mine = g == group
    group_first_tile = tl.sum(tl.where(mine, tile_ends - tiles, 0), axis=0)
    first_row = tl.sum(tl.where(mine, starts, 0), axis=0) + (m_tile - group_first_tile) * BLOCK_M
    return group, first_row, tl.sum(tl.where(mine, ends, 0), axis=0)


@triton.jit(do_not_specialize=["total_rows", "m_tiles"])
def _grouped_gemm_kernel(
    a_ptr, a_scale_ptr, row_index_ptr, w_ptr, w_scale_ptr, out_ptr, group_ends_ptr,
    total_rows, n, k, num_groups, m_tiles,
    a_row_stride, a_scale_group_stride, w_group_stride, w_row_stride, w_scale_group_stride, w_scale_row_stride,
    out_row_stride,
    SCALED: tl.constexpr, SINGLE_GROUP: tl.constexpr, GATHER: tl.constexpr, GROUPS_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WEIGHT_BLOCK_N: tl.constexpr,
    SWIZZLE: tl.constexpr, EVEN_K: tl.constexpr,
):
    m_tile, n_tile = _swizzled_tile(m_tiles, n, BLOCK_N, SWIZZLE)
    if SINGLE_GROUP:
        first_row = m_tile * BLOCK_M
        row_end = total_rows
        w_offset = 0
        w_scale_offset = 0
    else:
        group, first_row, row_end = _group_of_tile(m_tile, group_ends_ptr, num_groups, GROUPS_POW2, BLOCK_M)
        if group >= num_groups:
            return
        w_offset = group.to(tl.int64) * w_group_stride
        w_scale_offset = group.to(tl.int64) * w_scale_group_stride

    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    if GATHER:
        source_rows = tl.load(row_index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        source_rows = rows.to(tl.int64)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + source_rows[:, None] * a_row_stride + ks[None, :]
    w_ptrs = w_ptr + w_offset + cols[None, :].to(tl.int64) * w_row_stride + ks[:, None]
    a_scale_ptrs = a_scale_ptr + source_rows
    # A tile inside one weight block along N has one weight scale per K block: the scales fold into one per-row
    # factor and one FMA per product element.
    ONE_W_SCALE: tl.constexpr = WEIGHT_BLOCK_N % BLOCK_N == 0
    if ONE_W_SCALE:
        w_scale_ptrs = w_scale_ptr + w_scale_offset + (n_tile * BLOCK_N // WEIGHT_BLOCK_N) * w_scale_row_stride
    else:
        w_scale_ptrs = w_scale_ptr + w_scale_offset + (cols // WEIGHT_BLOCK_N) * w_scale_row_stride

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(k, BLOCK_K)):
        if EVEN_K:  # no mask along K, the loads' contiguous dimension, so they stay vectorized
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < k - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if SCALED:
            a_scale = tl.load(a_scale_ptrs + kb * a_scale_group_stride, mask=row_ok, other=0.0)
            if ONE_W_SCALE:
                acc = tl.fma(tl.dot(a, w), (a_scale * tl.load(w_scale_ptrs + kb))[:, None], acc)
            else:
                w_scale = tl.load(w_scale_ptrs + kb, mask=col_ok, other=0.0)
                acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
        else:
            acc += tl.dot(a, w)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * out_row_stride + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["m_tiles"])
def _grouped_fp8_gemm_tma_kernel(
    a_desc, a_scale_ptr, w_desc, w_scale_ptr, out_ptr, group_ends_ptr, n, k, num_groups, m_tiles,
    a_scale_group_stride, w_scale_group_stride, w_scale_row_stride, out_row_stride,
    GROUPS_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWIZZLE: tl.constexpr, STAGES: tl.constexpr,
):
    """Block-FP8 rows sorted by group (contiguous, no index), weights [groups * n, k]; BLOCK_N = the weight block's
    rows, BLOCK_K its columns, so each K step has one weight scale. A tile's TMA box may run into the next group's
    rows (computed, not stored) or past the last row (zeros)."""
    m_tile, n_tile = _swizzled_tile(m_tiles, n, BLOCK_N, SWIZZLE)
    group, first_row, row_end = _group_of_tile(m_tile, group_ends_ptr, num_groups, GROUPS_POW2, BLOCK_M)
    if group >= num_groups:
        return
    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    w_row = group * n + n_tile * BLOCK_N
    a_scale_ptrs = a_scale_ptr + rows
    w_scale_ptrs = w_scale_ptr + group.to(tl.int64) * w_scale_group_stride + n_tile * w_scale_row_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in tl.range(0, tl.cdiv(k, BLOCK_K), num_stages=STAGES):
        a = a_desc.load([first_row, kb * BLOCK_K])
        w = w_desc.load([w_row, kb * BLOCK_K])
        scale = tl.load(a_scale_ptrs + kb * a_scale_group_stride, mask=row_ok, other=0.0) * tl.load(w_scale_ptrs + kb)
        acc = tl.fma(tl.dot(a, w.T), scale[:, None], acc)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * out_row_stride + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < n)[None, :])


@dataclass(frozen=True)
class GemmTiles:
    """A launch's tiling: output tiles of block_m x block_n, warps per program, pipeline stages of the K loop."""

    block_m: int
    block_n: int
    warps: int
    stages: int = 4


def tiles_for(rows_per_group: float) -> GemmTiles:
    """Tiles for groups of about this many rows: small where rows are few (decode, where the weights' bytes are the
    cost and more column tiles keep more SMs reading), 64 x 128 over 4 warps and 3 stages where the GEMM is
    compute-bound: swept on an H100 at V3's expert shapes, it matched or beat 128 x 128 over 8 warps with either
    kernel (benchmarks/gpu_grouped_gemm.py --prefill; docs/benchmarks.md), and several of its programs share an SM,
    so one's MMAs run while another applies its scales."""
    if rows_per_group <= 16:
        return GemmTiles(16, 64, 4)
    if rows_per_group <= 32:
        return GemmTiles(32, 64, 4)
    if rows_per_group <= 64:
        return GemmTiles(64, 128, 4)
    return GemmTiles(64, 128, 4, stages=3)


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """Hopper and newer; on the CPU, Triton's interpreter (the only way Triton kernels run there) emulates TMA."""
    return device.type == "cpu" or torch.cuda.get_device_capability(device)[0] >= 9


def tma_takes(weight: BlockFP8Weight, rows: int, device: torch.device) -> bool:
    """Whether a grouped product of `rows` rows sorted by group takes a kernel for sorted rows (CUTLASS's or
    grouped_fp8_gemm_tma): its tiles (tiles_for) as wide as a weight block, i.e. over 32 rows per group, so each K
    step has one weight scale; whole K blocks; stacked weights contiguous (a 2-D descriptor over them); a GPU with
    TMA. Its rows must be gathered beforehand (quantize_rows(row_index=...))."""
    values = weight.values
    groups, n, k = values.shape if values.dim() == 3 else (0, 0, 0)
    return (groups > 0 and tiles_for(rows / groups).block_n == weight.block_size[0] and k % weight.block_size[1] == 0
            and values.is_contiguous() and _has_tma(device))


def fp8_gemm(q: torch.Tensor, scales: torch.Tensor, weight: BlockFP8Weight, rows: int,
             group_ends: torch.Tensor | None = None, row_index: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.bfloat16, tiles: GemmTiles | None = None) -> torch.Tensor:
    """out[i] = row i of the activations times its group's weight, for `rows` output rows.

    q, scales: quantize_rows() output. Dense (`group_ends` None): weight [N, K], output row i is activation row i.
    Grouped: weight [groups, N, K], `group_ends` [groups] int32 cumulative row ends (rows sorted by group), output
    row i is activation row `row_index[i]` (or row i without an index) times weight[group of i]. `tiles`: the
    tiling (tiles_for()'s choice by default)."""
    values, scale_inv = weight.values, weight.scale_inv
    block_k = weight.block_size[1]
    if values.stride(-1) != 1 or not scale_inv.is_contiguous():
        raise ValueError("FP8 weights must be contiguous along K, with a contiguous scale grid")
    if block_k & (block_k - 1):
        raise ValueError(f"the Triton FP8 GEMM takes K blocks of a power of two, got {block_k}")
    return _grouped_gemm(q, values, rows, group_ends, row_index, out_dtype, block_k,
                         (scales, scale_inv, weight.block_size[0]), tiles)


def grouped_fp8_gemm_tma(q: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, scale_inv: torch.Tensor,
                         group_ends: torch.Tensor, block_k: int) -> torch.Tensor:
    """q [rows, K] FP8 sorted by group and its quantize_rows() scales, values [groups, N, K] and their scale grid of
    (tile width) x block_k blocks, as tma_takes() allows -> [rows, N] bf16."""
    rows, k = q.shape
    groups, n, _ = values.shape
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=q.device)
    if rows == 0:
        return out
    tiles = tiles_for(rows / groups)
    a_desc = TensorDescriptor.from_tensor(q, [tiles.block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(values.view(groups * n, k), [tiles.block_n, block_k])
    m_tiles = grouped_m_tiles(rows, groups, tiles.block_m)
    _grouped_fp8_gemm_tma_kernel[(m_tiles * triton.cdiv(n, tiles.block_n),)](
        a_desc, scales, w_desc, scale_inv, out, group_ends, n, k, groups, m_tiles,
        scales.stride(0), scale_inv.stride(0), scale_inv.stride(1), out.stride(0),
        GROUPS_POW2=max(2, triton.next_power_of_2(groups)), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=block_k, SWIZZLE=SWIZZLE_M, STAGES=tiles.stages, num_warps=tiles.warps,
    )
    return out


def grouped_m_tiles(rows: int, groups: int, block_m: int) -> int:
    """m-tiles a grouped launch needs room for, whatever the split of `rows` over `groups`: a group's rows fill whole
    tiles and at most one partial one, and at most `rows` groups have any (at decode sizes, 6 rows over 64 experts
    launch 6 m-tiles' programs, not 65 that mostly leave at once)."""
    return rows // block_m + min(groups, rows)


def bf16_grouped_gemm(x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor,
                      row_index: torch.Tensor | None = None, tiles: GemmTiles | None = None) -> torch.Tensor:
    """out[i] = x[row_index[i]] (x[i] without an index) times weight[group of i]^T: x [M, K] bf16, weight [groups, N, K]
    bf16 contiguous along K, `group_ends` [groups] int32 cumulative row ends (rows sorted by group). `tiles` as in
    fp8_gemm."""
    if weight.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("the bf16 grouped GEMM takes activations and weights contiguous along K")
    rows = row_index.numel() if row_index is not None else x.shape[0]
    return _grouped_gemm(x, weight, rows, group_ends, row_index, x.dtype, BF16_BLOCK_K, None, tiles)


def _grouped_gemm(a: torch.Tensor, values: torch.Tensor, rows: int, group_ends: torch.Tensor | None,
                  row_index: torch.Tensor | None, out_dtype: torch.dtype, block_k: int,
                  fp8_scales: tuple[torch.Tensor, torch.Tensor, int] | None, tiles: GemmTiles | None) -> torch.Tensor:
    """The launch both forms share; `fp8_scales`: (activation scales, weight scale grid, weight block rows)."""
    n, k = values.shape[-2:]
    if a.shape[1] != k:
        raise ValueError(f"activations have {a.shape[1]} columns, the weight takes {k}")
    single = group_ends is None
    num_groups = 1 if single else group_ends.numel()
    out = torch.empty(rows, n, dtype=out_dtype, device=a.device)
    if rows == 0:
        return out
    tiles = tiles or tiles_for(rows / num_groups)
    m_tiles = triton.cdiv(rows, tiles.block_m) if single else grouped_m_tiles(rows, num_groups, tiles.block_m)
    grid = (m_tiles * triton.cdiv(n, tiles.block_n),)
    stacked = values.dim() == 3
    scales, scale_inv, weight_block_n = fp8_scales if fp8_scales is not None else (a, a, 1)
    _grouped_gemm_kernel[grid](
        a, scales, row_index if row_index is not None else a, values, scale_inv, out,
        group_ends if group_ends is not None else a,
        rows, n, k, num_groups, m_tiles,
        a.stride(0), scales.stride(0), values.stride(0) if stacked else 0, values.stride(-2),
        scale_inv.stride(0) if fp8_scales is not None and stacked else 0,
        scale_inv.stride(-2) if fp8_scales is not None else 0, out.stride(0),
        SCALED=fp8_scales is not None, SINGLE_GROUP=single, GATHER=row_index is not None,
        GROUPS_POW2=max(2, triton.next_power_of_2(num_groups)),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k, WEIGHT_BLOCK_N=weight_block_n,
        SWIZZLE=SWIZZLE_M, EVEN_K=k % block_k == 0, num_warps=tiles.warps, num_stages=tiles.stages,
    )
    return out


# An operator of its own, so torch.compile takes the kernel as one opaque call (its output shape below) when it
# traces the routed experts whole for the decode graphs.
@torch.library.custom_op("pdserve::bf16_grouped_gemm", mutates_args=())
def bf16_grouped_gemm_op(x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor,
                         row_index: torch.Tensor | None) -> torch.Tensor:
    return bf16_grouped_gemm(x, weight, group_ends, row_index)


@bf16_grouped_gemm_op.register_fake
def _(x, weight, group_ends, row_index):
    rows = row_index.shape[0] if row_index is not None else x.shape[0]
    return x.new_empty(rows, weight.shape[1])
