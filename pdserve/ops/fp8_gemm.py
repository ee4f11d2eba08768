"""Linear layers on block-FP8 weights (pdserve.ops.block_fp8): dense, and grouped over rows sorted by expert.

Two paths behind each call. The reference dequantizes the weight and multiplies in the activations' dtype: exact for
the stored weights and correct on any device, but it rebuilds the full-precision weight on every call. The CUDA path
(bf16 activations) quantizes the activations too, one float32 scale per token per 128 columns (the weight's K
block), multiplies on FP8 tensor cores with both scales applied per K block, and writes bf16: cuBLAS blockwise
scaling (`torch._scaled_mm`, 1x128 activations x 128x128 weights, SM90) where its layout rules hold, our Triton
kernel (pdserve.ops.gemm_triton) for the other shapes and for the grouped form. Their difference from the reference
is the activations' FP8 rounding (e4m3: 3 mantissa bits, ~2-4% relative per product), not the weights'.
"""

import functools

import torch
import torch.nn.functional as F

from pdserve.ops.block_fp8 import BlockFP8Weight, dequantize_block_fp8, quantize_block_fp8

CUBLAS_BLOCK = (128, 128)
CUBLAS_ROW_MULTIPLE = 4  # cuBLASLt wants the 1x128 scales' leading dimension (the row count) 16-byte aligned


def uses_fp8_kernels(x: torch.Tensor) -> bool:
    """Whether a product with these activations takes the FP8 tensor-core path: bf16 on CUDA. float32 activations
    (the GPU float32 reference) and the CPU take the reference."""
    return x.is_cuda and x.dtype == torch.bfloat16


def block_fp8_linear(x: torch.Tensor, weight: BlockFP8Weight) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T -> [..., out] in x's dtype."""
    if not uses_fp8_kernels(x):
        return block_fp8_linear_reference(x, weight)
    flat = x.reshape(-1, x.shape[-1])
    if cublas_takes(weight, x.device):
        out = block_fp8_linear_cublas(flat, weight)
    else:
        out = block_fp8_linear_triton(flat, weight)
    return out.view(*x.shape[:-1], weight.shape[0])


def block_fp8_linear_reference(x: torch.Tensor, weight: BlockFP8Weight) -> torch.Tensor:
    return F.linear(x, weight.dequantize(x.dtype))


def block_fp8_linear_emulated(x: torch.Tensor, weight: BlockFP8Weight) -> torch.Tensor:
    """What the FP8 kernels compute, in float32 torch: activations rounded to FP8 in 1 x block_k groups, then the
    reference product. The fast paths' slow twin (tests, benchmarks)."""
    group = (1, weight.block_size[1])
    activations = dequantize_block_fp8(*quantize_block_fp8(x.reshape(-1, x.shape[-1]), group), group)
    out = F.linear(activations, weight.dequantize(torch.float32))
    return out.view(*x.shape[:-1], weight.shape[0]).to(x.dtype)


@functools.cache
def is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def cublas_takes(weight: BlockFP8Weight, device: torch.device) -> bool:
    """cuBLAS blockwise FP8 runs only on SM90 with 128x128 weight blocks. Whole blocks are asked for (PyTorch
    versions disagree on partial ones), and K in multiples of 4 blocks: the weight's scale grid must then have rows
    of a multiple of 4 floats, which our contiguous grid has without padding."""
    if weight.values.dim() != 2 or weight.block_size != CUBLAS_BLOCK:
        return False
    n, k = weight.shape
    return n % CUBLAS_BLOCK[0] == 0 and k % (4 * CUBLAS_BLOCK[1]) == 0 and is_sm90(device)


def block_fp8_linear_cublas(x: torch.Tensor, weight: BlockFP8Weight) -> torch.Tensor:
    """x [M, K] bf16 on an SM90 GPU, weight as cublas_takes() allows -> [M, N] bf16."""
    from pdserve.ops.gemm_triton import quantize_rows

    q, scales = quantize_rows(x, CUBLAS_BLOCK[1], pad_rows_to=CUBLAS_ROW_MULTIPLE)
    # Operand layouts _scaled_mm reads as DeepSeek scaling: activations row-major with [M, K/128] scales stored
    # column-major; the weight column-major ([K, N] view of [N, K]) with its [K/128, N/128] scale view likewise.
    out = torch._scaled_mm(q, weight.values.t(), scale_a=scales.t(), scale_b=weight.scale_inv.t(),
                           out_dtype=torch.bfloat16)
    return out[: x.shape[0]]


def block_fp8_linear_triton(x: torch.Tensor, weight: BlockFP8Weight) -> torch.Tensor:
    """x [M, K] bf16 on CUDA -> [M, N] bf16, any shape and block size."""
    from pdserve.ops.gemm_triton import fp8_gemm, quantize_rows

    q, scales = quantize_rows(x, weight.block_size[1])
    return fp8_gemm(q, scales, weight, rows=x.shape[0])


def block_fp8_grouped_linear(x: torch.Tensor, weight: BlockFP8Weight, group_ends: torch.Tensor,
                             row_index: torch.Tensor | None = None) -> torch.Tensor:
    """Rows sorted by group, each times its group's weight: row i of the result is x[row_index[i]] (x[i] without an
    index) @ weight[g]^T for the group g whose rows [group_ends[g-1], group_ends[g]) hold i. weight [groups, N, K],
    group_ends int32 on x's device. Rows past the last end are left unset (GroupedMoE sorts foreign slots there)."""
    if not uses_fp8_kernels(x):
        return block_fp8_grouped_linear_reference(x, weight, group_ends, row_index)
    return block_fp8_grouped_linear_kernels(x, weight, group_ends, row_index)


def block_fp8_grouped_linear_kernels(x: torch.Tensor, weight: BlockFP8Weight, group_ends: torch.Tensor,
                                     row_index: torch.Tensor | None = None) -> torch.Tensor:
    """block_fp8_grouped_linear's kernels: x bf16 on CUDA (or CPU tensors in Triton's interpreter)."""
    from pdserve.ops.gemm_triton import fp8_gemm, quantize_rows, tma_takes

    rows = x.shape[0] if row_index is None else row_index.numel()
    if tma_takes(weight, rows, x.device):
        # Prefill sizes: the rows gathered as they are quantized, so the GEMM loads whole tiles by TMA.
        q, scales = quantize_rows(x, weight.block_size[1], row_index=row_index)
        return block_fp8_grouped_linear_quantized(q, scales, weight, group_ends)
    # Decode sizes: each token quantized once, its rows gathered (one per routed slot) inside the GEMM.
    q, scales = quantize_rows(x, weight.block_size[1])
    return fp8_gemm(q, scales, weight, rows=rows, group_ends=group_ends, row_index=row_index)


def takes_quantized_sorted_rows(x: torch.Tensor, weight: torch.Tensor | BlockFP8Weight) -> bool:
    """Whether block_fp8_grouped_linear(x, weight, group_ends), rows sorted and without an index, quantizes x with
    quantize_rows() and hands the rows to block_fp8_grouped_linear_quantized(): block-FP8 weights, the kernels
    (uses_fp8_kernels) at prefill sizes (tma_takes). Rows quantized another way in that layout may be handed instead."""
    if not isinstance(weight, BlockFP8Weight) or not uses_fp8_kernels(x):
        return False
    from pdserve.ops.gemm_triton import tma_takes

    return tma_takes(weight, x.shape[0], x.device)


def block_fp8_grouped_linear_quantized(q: torch.Tensor, scales: torch.Tensor, weight: BlockFP8Weight,
                                       group_ends: torch.Tensor) -> torch.Tensor:
    """Rows quantized in quantize_rows()'s layout, sorted by group, times their groups' weights, as tma_takes()
    allows -> [rows, N] bf16."""
    # Eagerly the plain function: the operator's dispatch costs host time a call, which large eager prefill steps,
    # host-bound in FP8, feel.
    gemm = grouped_fp8_gemm_sorted_op if torch.compiler.is_compiling() else grouped_fp8_gemm_sorted
    return gemm(q, scales, weight.values, weight.scale_inv, group_ends, *weight.block_size)


def grouped_fp8_gemm_sorted(q: torch.Tensor, scales: torch.Tensor, values: torch.Tensor, scale_inv: torch.Tensor,
                            group_ends: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """Block-FP8 rows already gathered and sorted by group, as tma_takes() allows -> [rows, N] bf16: CUTLASS's
    kernel on SM90 where it builds (pdserve.ops.cutlass_fp8), our Triton TMA kernel otherwise."""
    from pdserve.ops import cutlass_fp8
    from pdserve.ops.gemm_triton import grouped_fp8_gemm_tma

    if cutlass_fp8.serves(values, (block_n, block_k), q.device):
        return cutlass_fp8.grouped_fp8_gemm(q, scales, values, scale_inv, group_ends)
    return grouped_fp8_gemm_tma(q, scales, values, scale_inv, group_ends, block_k)


# An operator of its own for compiled regions: torch.compile takes the launch (TMA descriptors built on the host, or
# a ctypes call) as one opaque call.
grouped_fp8_gemm_sorted_op = torch.library.custom_op("pdserve::grouped_fp8_gemm_sorted", mutates_args=())(
    grouped_fp8_gemm_sorted)


@grouped_fp8_gemm_sorted_op.register_fake
def _(q, scales, values, scale_inv, group_ends, block_n, block_k):
    return q.new_empty(q.shape[0], values.shape[1], dtype=torch.bfloat16)


def block_fp8_grouped_linear_reference(x: torch.Tensor, weight: BlockFP8Weight, group_ends: torch.Tensor,
                                       row_index: torch.Tensor | None = None) -> torch.Tensor:
    rows = x if row_index is None else x[row_index]
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    start = 0
    for group, end in enumerate(group_ends.tolist()):
        out[start:end] = F.linear(rows[start:end], weight[group].dequantize(rows.dtype))
        start = end
    return out
