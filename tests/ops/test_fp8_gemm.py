"""Block-FP8 linears. The reference is dequantize-then-matmul. The CUDA kernels (cuBLAS and Triton, dense and
grouped) quantize the activations to FP8 too, so they are held to two bounds: close to the FP8 emulation (the same
rounded activations in float32 torch: only accumulation order and the bf16 output differ, < 1e-2) and near the
reference within the activations' FP8 rounding (e4m3 keeps 3 mantissa bits: ~3% relative per product, < 6e-2).

Kernel tests run on CUDA (marked gpu) and, for the Triton kernels, in Triton's CPU interpreter when
TRITON_INTERPRET=1 (a separate venv with triton; CI has neither, and skips them). The Triton GEMM's bf16 form (the
routed experts' kernel for bf16 weights) is checked here too, against float32.
"""

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from pdserve.ops.block_fp8 import BlockFP8Weight, dequantize_block_fp8, quantize_block_fp8
from pdserve.ops.fp8_gemm import (
    block_fp8_grouped_linear,
    block_fp8_grouped_linear_reference,
    block_fp8_linear,
    block_fp8_linear_emulated,
    block_fp8_linear_reference,
    cublas_takes,
)

KERNEL_TO_EMULATION = 1e-2
KERNEL_TO_REFERENCE = 6e-2
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
KERNEL_DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu),
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 and triton")),
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_weight(shape: tuple[int, ...], seed: int = 0, device: str = "cpu") -> BlockFP8Weight:
    """Drawn and quantized on `device` (V3's expert stacks are ~1e9 values)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5
    return BlockFP8Weight(*quantize_block_fp8(weight), (128, 128))


def random_activations(rows: int, cols: int, device: str, seed: int = 1) -> torch.Tensor:
    # A few large channels, as real activations have: per-group scales must keep the small ones.
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[:, ::97] *= 20
    return x.to(device, torch.bfloat16)


def sorted_groups(num_tokens: int, top_k: int, groups: int, device: str, seed: int = 2):
    """(row_index, group_ends) as GroupedMoE sorts routed slots; every group after the first few left empty when
    there are fewer slots than groups."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(groups, generator=gen)[:top_k] for _ in range(num_tokens)]).reshape(-1)
    sorted_ids, order = torch.sort(ids)
    ends = torch.searchsorted(sorted_ids, torch.arange(1, groups + 1), right=False).to(torch.int32)
    return (order // top_k).to(device), ends.to(device)


def test_reference_linear_is_dequantize_then_matmul():
    weight = random_weight((300, 160))
    dense = dequantize_block_fp8(weight.values, weight.scale_inv, (128, 128))
    x = torch.randn(2, 5, 160, generator=torch.Generator().manual_seed(3))
    out = block_fp8_linear(x, weight)  # float32 on the CPU: the reference
    assert out.shape == (2, 5, 300)
    torch.testing.assert_close(out, x @ dense.T, rtol=1e-6, atol=1e-6)


def test_grouped_reference_is_each_row_times_its_group():
    weight = random_weight((4, 200, 300))
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(4))
    row_index, ends = sorted_groups(7, 2, 4, "cpu")
    out = block_fp8_grouped_linear(x, weight, ends, row_index)
    group_of = torch.bucketize(torch.arange(14), ends.long(), right=True)
    for row in range(14):
        expected = weight[int(group_of[row])].dequantize() @ x[row_index[row]]
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-5)


def test_fp8_activation_rounding_is_what_the_kernel_bound_allows():
    """The emulated kernel's distance from the reference is the FP8 rounding of the activations: clearly above the
    bf16 level and under the bound the kernels are held to."""
    weight = random_weight((256, 1024))
    x = random_activations(64, 1024, "cpu")
    err = rel_err(block_fp8_linear_emulated(x, weight), block_fp8_linear_reference(x.float(), weight))
    assert 1e-2 < err < KERNEL_TO_REFERENCE / 2


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_quantize_rows_matches_torch_block_quantization(device):
    from pdserve.ops.gemm_triton import quantize_rows

    x = random_activations(37, 300, device)  # partial last group, rows padded to 40
    q, scales = quantize_rows(x, 128, pad_rows_to=4)
    assert q.shape == (40, 300) and scales.shape == (3, 40)
    ref_q, ref_scales = quantize_block_fp8(x, (1, 128))
    torch.testing.assert_close(scales.t()[:37], ref_scales, rtol=1e-6, atol=0)
    assert torch.equal(scales[:, 37:], torch.ones(3, 3, device=device)) and not q[37:].float().any()
    if device == "cpu":
        pytest.xfail("the interpreter drops the carry when FP8 rounding raises the exponent (124.3 -> 64, not 128)")
    mismatched = (q[:37].view(torch.uint8) != ref_q.view(torch.uint8)).float().mean().item()
    assert mismatched < 1e-3  # division rounding may flip a code at a rounding boundary, no more


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_quantize_rows_gathers_by_index(device):
    from pdserve.ops.gemm_triton import quantize_rows

    x = random_activations(37, 300, device)
    row_index = torch.tensor([5, 0, 36, 5, 12, 7, 7, 30], device=device)
    q, scales = quantize_rows(x, 128, row_index=row_index)
    ref_q, ref_scales = quantize_rows(x[row_index], 128)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scales, ref_scales)


def silu_and_mul_quantize_reference(gate_up: torch.Tensor, weights: torch.Tensor, group: int,
                                    pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """silu_and_mul_quantize's slow twin: SiLU(gate) * up * weight in float32 (never rounded to bf16), quantized by
    torch in 1 x group blocks and laid out as quantize_rows() lays out its result (padding rows zeros of scale 1).
    Returns (FP8 rows, scales, the float32 activations)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    activations = F.silu(gate) * up * weights.float()[:, None]
    padded_rows = -(-activations.shape[0] // pad_rows_to) * pad_rows_to
    q, scales = quantize_block_fp8(F.pad(activations, (0, 0, 0, padded_rows - activations.shape[0])), (1, group))
    return q, scales.t().contiguous(), activations


def fp8_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable e4m3 values lie between a and b, +0 and -0 the same: codes of one sign are ordered by
    magnitude, so a signed magnitude code counts them."""
    def ordinal(q: torch.Tensor) -> torch.Tensor:
        code = q.view(torch.uint8).int()
        return torch.where(code >= 0x80, -(code & 0x7F), code)
    return (ordinal(a) - ordinal(b)).abs()


def random_gate_up(rows: int, inter: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [rows, 2 * inter] bf16 with a few large channels, and routing weights; rows 0-2 all zeros, row 3 of
    weight zero, row 4 of gate zero: each quantizes to zeros of scale 1."""
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 3
    gate_up[:, ::97] *= 20
    gate_up[:3] = 0
    gate_up[4, :inter] = 0
    weights = torch.rand(rows, generator=gen)
    weights[3] = 0
    return gate_up.to(device, torch.bfloat16), weights.to(device)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's exp of -gate, large gates
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("inter", [2048, 256, 200])  # V3's; whole groups; a partial last group
def test_silu_and_mul_quantize_matches_torch_activation_then_quantization(device, inter):
    """Scales as torch's (up to the float32 rounding of exp), codes within one FP8 step of torch's (an activation an
    ulp apart may round the other way at a boundary), in quantize_rows()'s layout: 37 rows (a partial block of rows)
    padded to 40. In the interpreter, whose FP8 cast drops the carry into the exponent (see the quantize test), the
    codes are held to quantize_rows() of the reference activations, which shares that cast."""
    from pdserve.ops.gemm_triton import quantize_rows, silu_and_mul_quantize

    gate_up, weights = random_gate_up(37, inter, device)
    q, scales = silu_and_mul_quantize(gate_up, weights, 128, pad_rows_to=4)
    ref_q, ref_scales, activations = silu_and_mul_quantize_reference(gate_up, weights, 128, pad_rows_to=4)
    layout_q, layout_scales = quantize_rows(activations, 128, pad_rows_to=4)
    assert q.dtype == layout_q.dtype and q.shape == layout_q.shape == ref_q.shape == (40, inter)
    assert scales.shape == layout_scales.shape == ref_scales.shape and scales.stride() == layout_scales.stride()
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    zero_rows = [0, 1, 2, 3, 4, 37, 38, 39]
    assert torch.equal(scales[:, zero_rows], torch.ones_like(scales[:, zero_rows])) and not q[zero_rows].float().any()
    steps = fp8_steps_apart(q, ref_q if device == "cuda" else layout_q)
    assert steps.max() <= 1 and (steps > 0).float().mean() < 1e-3


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_sorted_grouped_gemm_takes_silu_and_mul_quantize_rows_unchanged(device):
    """The fused kernel's rows and scales, handed to the sorted grouped GEMM as they are, give the product of the
    values they encode: the layout is quantize_rows()'s."""
    from pdserve.ops.gemm_triton import grouped_fp8_gemm_tma, silu_and_mul_quantize

    weight = random_weight((4, 256, 384), device=device)
    gate_up, weights = random_gate_up(150, 384, device)
    ends = torch.tensor([40, 40, 110, 150], dtype=torch.int32, device=device)  # group 1 empty
    q, scales = silu_and_mul_quantize(gate_up, weights, 128)
    out = grouped_fp8_gemm_tma(q, scales, weight.values, weight.scale_inv, ends, weight.block_size[1])
    encoded = dequantize_block_fp8(q, scales.t(), (1, 128))
    assert rel_err(out, block_fp8_grouped_linear_reference(encoded, weight, ends)) < KERNEL_TO_EMULATION


def kernel_shapes(device: str) -> list[tuple[int, int]]:
    """(out, in): partial weight blocks in both dims; on the GPU also V3's shapes."""
    if device == "cpu":
        return [(200, 300)]
    return [(576, 7168), (300, 10944), (2048, 7168), (7168, 2048)]


def kernel_inputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows() on CUDA; in the interpreter, torch's rounding laid out as the kernel's (the interpreter's FP8
    cast is wrong where rounding carries into the exponent: see the quantize test)."""
    from pdserve.ops.gemm_triton import quantize_rows

    if x.is_cuda:
        return quantize_rows(x, 128)
    q, scales = quantize_block_fp8(x, (1, 128))
    return q, scales.t().contiguous()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_triton_dense_gemm_matches_emulation_and_reference(device):
    from pdserve.ops.gemm_triton import fp8_gemm

    for rows in (1, 16, 67) if device == "cpu" else (1, 64, 4096):
        for shape in kernel_shapes(device):
            weight = random_weight(shape, device=device)
            x = random_activations(rows, shape[1], device)
            out = fp8_gemm(*kernel_inputs(x), weight, rows=rows)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, shape[0])
            assert rel_err(out, block_fp8_linear_emulated(x, weight)) < KERNEL_TO_EMULATION, (rows, shape)
            assert rel_err(out, block_fp8_linear_reference(x.float(), weight)) < KERNEL_TO_REFERENCE, (rows, shape)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 64, 4096])
def test_cublas_dense_gemm_matches_emulation_and_reference(rows):
    from pdserve.ops.fp8_gemm import block_fp8_linear_cublas

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("cuBLAS blockwise FP8 scaling runs on SM90")
    for shape in [(2048, 7168), (7168, 2048), (24576, 1536)]:
        weight = random_weight(shape, device="cuda")
        assert cublas_takes(weight, torch.device("cuda"))
        x = random_activations(rows, shape[1], "cuda")
        out = block_fp8_linear_cublas(x, weight)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, shape[0])
        assert rel_err(out, block_fp8_linear_emulated(x, weight)) < KERNEL_TO_EMULATION, (rows, shape)
        assert rel_err(out, block_fp8_linear_reference(x.float(), weight)) < KERNEL_TO_REFERENCE, (rows, shape)
    assert not cublas_takes(random_weight((576, 7168), device="cuda"), torch.device("cuda"))  # partial N block


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_triton_grouped_gemm_matches_emulation_and_reference(device):
    """Routed experts at decode and prefill sizes (on the GPU: EP8's 32 local experts of V3, 8 slots per token;
    the decode case leaves most experts empty)."""
    from pdserve.ops.gemm_triton import fp8_gemm

    if device == "cpu":
        cases = [(3, 2, (4, 200, 300)), (40, 2, (4, 200, 300))]
    else:
        cases = [(t, 8, shape) for t in (2, 64, 2048) for shape in ((32, 4096, 7168), (32, 7168, 2048))]
    for tokens, top_k, shape in cases:
        weight = random_weight(shape, device=device)
        x = random_activations(tokens, shape[2], device)
        row_index, ends = sorted_groups(tokens, top_k, shape[0], device)
        out = fp8_gemm(*kernel_inputs(x), weight, rows=row_index.numel(), group_ends=ends, row_index=row_index)
        assert out.dtype == torch.bfloat16 and out.shape == (tokens * top_k, shape[1])
        group = (1, 128)
        emulated_x = dequantize_block_fp8(*quantize_block_fp8(x, group), group)
        emulated = block_fp8_grouped_linear_reference(emulated_x, weight, ends, row_index)
        reference = block_fp8_grouped_linear_reference(x.float(), weight, ends, row_index)
        assert rel_err(out, emulated) < KERNEL_TO_EMULATION, (tokens, shape)
        assert rel_err(out, reference) < KERNEL_TO_REFERENCE, (tokens, shape)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_sorted_grouped_gemms_match_emulation_and_reference(device):
    """Prefill-sized groups of rows gathered beforehand: our Triton TMA kernel, and on the GPU also the path
    GroupedMoE takes (block_fp8_grouped_linear: CUTLASS's kernel on SM90 where it builds). Groups of a partial tile,
    of several tiles and empty; on the GPU V3's EP8 expert shapes."""
    from pdserve.ops.gemm_triton import grouped_fp8_gemm_tma, tma_takes

    if device == "cpu":
        cases = [(150, 2, (4, 256, 384))]
    else:
        cases = [(t, 8, shape) for t in (512, 4096) for shape in ((32, 4096, 7168), (32, 7168, 2048))]
    for tokens, top_k, shape in cases:
        weight = random_weight(shape, device=device)
        x = random_activations(tokens, shape[2], device)
        row_index, ends = sorted_groups(tokens, top_k, shape[0], device)
        ends[1] = ends[0]  # group 1 empty
        rows = row_index.numel()
        assert tma_takes(weight, rows, torch.device(device))
        outputs = {"Triton TMA": grouped_fp8_gemm_tma(*kernel_inputs(x[row_index]), weight.values, weight.scale_inv,
                                                      ends, weight.block_size[1])}
        if device == "cuda":
            outputs["as served"] = block_fp8_grouped_linear(x, weight, ends, row_index)
        group = (1, 128)
        emulated_x = dequantize_block_fp8(*quantize_block_fp8(x, group), group)
        valid = int(ends[-1])  # rows past the last end are left unset, as GroupedMoE's foreign slots
        emulated = block_fp8_grouped_linear_reference(emulated_x, weight, ends, row_index)[:valid]
        reference = block_fp8_grouped_linear_reference(x.float(), weight, ends, row_index)[:valid]
        for kernel, out in outputs.items():
            assert out.dtype == torch.bfloat16 and out.shape == (rows, shape[1])
            assert rel_err(out[:valid], emulated) < KERNEL_TO_EMULATION, (kernel, tokens, shape)
            assert rel_err(out[:valid], reference) < KERNEL_TO_REFERENCE, (kernel, tokens, shape)


@pytest.mark.gpu
def test_cutlass_grouped_gemm_replays_in_a_cuda_graph_with_new_groups():
    """The CUTLASS kernel writes its per-group pointers, shapes and scales on the device, so a captured call replayed
    with other rows and another split into groups (same row count) gives what an eager call gives."""
    from pdserve.ops import cutlass_fp8
    from pdserve.ops.gemm_triton import quantize_rows

    device = torch.device("cuda")
    weight = random_weight((8, 256, 512), device="cuda")
    if not cutlass_fp8.serves(weight.values, weight.block_size, device):
        pytest.skip("CUTLASS's grouped FP8 GEMM runs on SM90 with nvcc and flashinfer's headers")
    x = random_activations(600, 512, "cuda")
    ends = torch.tensor([100, 100, 250, 300, 420, 500, 560, 600], dtype=torch.int32, device=device)

    def call() -> torch.Tensor:
        q, scales = quantize_rows(x, 128)
        return cutlass_fp8.grouped_fp8_gemm(q, scales, weight.values, weight.scale_inv, ends)

    call()  # warm-up off the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    x.copy_(random_activations(600, 512, "cuda", seed=7))
    ends.copy_(torch.tensor([0, 75, 75, 330, 331, 400, 599, 600], dtype=torch.int32))
    graph.replay()
    expected = call()
    assert torch.equal(captured, expected)
    emulated_x = dequantize_block_fp8(*quantize_block_fp8(x, (1, 128)), (1, 128))
    assert rel_err(captured, block_fp8_grouped_linear_reference(emulated_x, weight, ends)) < KERNEL_TO_EMULATION


def _build_with(nvcc: str, cache: str) -> str:
    import os

    from pdserve.ops import cutlass_fp8

    os.environ["PDSERVE_KERNEL_CACHE"] = cache
    return str(cutlass_fp8._build(nvcc, []))


def test_cutlass_library_is_compiled_once_by_processes_that_start_together(tmp_path):
    """Four processes (an EP instance's ranks on one host) ask for the library at once: one runs the compiler (a
    stand-in for nvcc that logs each compile and takes a second), the others wait for its lock and load the same
    file."""
    import multiprocessing

    nvcc = tmp_path / "nvcc"
    compiles = tmp_path / "compiles"
    nvcc.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "stand-in nvcc 1.0"; exit 0; fi
echo compile >> {compiles}
sleep 1
while [ "$#" -gt 1 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
echo library > "$out"
""")
    nvcc.chmod(0o755)
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        paths = pool.starmap(_build_with, [(str(nvcc), str(tmp_path / "cache"))] * 4, chunksize=1)
    assert len(set(paths)) == 1 and open(paths[0]).read() == "library\n"
    assert compiles.read_text().count("compile") == 1


def test_cutlass_kernel_takes_stacked_whole_128_blocks_only():
    from pdserve.ops import cutlass_fp8

    assert cutlass_fp8.takes(torch.empty(4, 256, 384, dtype=torch.float8_e4m3fn), (128, 128))
    assert not cutlass_fp8.takes(torch.empty(4, 200, 384, dtype=torch.float8_e4m3fn), (128, 128))  # partial N block
    assert not cutlass_fp8.takes(torch.empty(256, 384, dtype=torch.float8_e4m3fn), (128, 128))  # dense
    assert not cutlass_fp8.takes(torch.empty(4, 256, 384, dtype=torch.float8_e4m3fn), (64, 128))
    assert not cutlass_fp8.available(torch.device("cpu"))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("k", [256, 200])  # whole K blocks (unmasked loads) and a partial last block
def test_bf16_grouped_gemm_matches_float32_at_every_tiling(device, k):
    """Each tiling tiles_for() picks (decode to prefill sizes), rows gathered by index and not, an empty group. In
    the interpreter the same kernel runs on float32 tensors: its tl.dot on bf16 tiles returns garbage there (~1e11)."""
    from pdserve.ops.gemm_triton import bf16_grouped_gemm, tiles_for

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    groups, n = 6, 192
    weight = (torch.randn(groups, n, k, generator=torch.Generator().manual_seed(3)) * k**-0.5).to(device, dtype)
    x = random_activations(150, k, device).to(dtype)
    row_index, ends = sorted_groups(150, 2, groups, device)
    ends[1] = ends[0]  # group 1 empty
    starts = [0] + ends.tolist()[:-1]
    rows = x[row_index].float()
    reference = torch.cat([rows[a:b] @ weight[g].float().T for g, (a, b) in enumerate(zip(starts, ends.tolist()))])
    for rows_per_group in (1, 20, 50, 500):
        tiles = tiles_for(rows_per_group)
        out = bf16_grouped_gemm(x, weight, ends, row_index, tiles)
        assert out.dtype == dtype and out.shape == (300, n)
        assert rel_err(out, reference) < 1e-2, tiles
    assert rel_err(bf16_grouped_gemm(x[row_index], weight, ends), reference) < 1e-2


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_bf16_grouped_gemm_launch_covers_the_worst_split(device):
    """The launch holds one partial m-tile per group with rows, for at most as many groups as there are rows: decode's
    few rows over many groups, and every group one row past a whole tile (each needs two tiles) at that bound."""
    from pdserve.ops.gemm_triton import bf16_grouped_gemm, tiles_for

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n, k = 64, 128
    tiles = tiles_for(1)
    for groups, rows_per_group in ((64, 0), (4, tiles.block_m + 1)):
        counts = [1 if g % 9 == 0 else 0 for g in range(groups)] if rows_per_group == 0 else [rows_per_group] * groups
        ends = torch.tensor(counts).cumsum(0).to(device, torch.int32)
        weight = (torch.randn(groups, n, k, generator=torch.Generator().manual_seed(4)) * k**-0.5).to(device, dtype)
        x = random_activations(sum(counts), k, device).to(dtype)
        group_of_row = torch.repeat_interleave(torch.arange(groups), torch.tensor(counts))
        reference = torch.einsum("rk,rnk->rn", x.float().cpu(), weight.float().cpu()[group_of_row])
        out = bf16_grouped_gemm(x, weight, ends, None, tiles)
        assert rel_err(out.cpu(), reference) < 1e-2, (groups, rows_per_group)


@pytest.mark.gpu
def test_dispatch_takes_the_kernels_for_bf16_on_cuda_and_the_reference_otherwise():
    for shape in [(576, 7168), (2048, 7168)]:  # Triton; cuBLAS on SM90
        weight = random_weight(shape, device="cuda")
        x = random_activations(5, shape[1], "cuda")
        assert rel_err(block_fp8_linear(x, weight), block_fp8_linear_emulated(x, weight)) < KERNEL_TO_EMULATION
        assert torch.equal(block_fp8_linear(x.float(), weight), block_fp8_linear_reference(x.float(), weight))
    weight = random_weight((8, 256, 512), device="cuda")
    x = random_activations(6, 512, "cuda")
    row_index, ends = sorted_groups(6, 2, 8, "cuda")
    fast = block_fp8_grouped_linear(x, weight, ends, row_index)
    emulated_x = dequantize_block_fp8(*quantize_block_fp8(x, (1, 128)), (1, 128))
    assert rel_err(fast, block_fp8_grouped_linear_reference(emulated_x, weight, ends, row_index)) < KERNEL_TO_EMULATION
