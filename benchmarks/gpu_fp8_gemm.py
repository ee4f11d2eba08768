"""Block-FP8 GEMMs against bf16 on DeepSeek-V3 shapes: time, TFLOP/s and error against the float32 reference.

Dense linears of a V3 layer, and the routed experts of one EP8 rank (32 local experts of 256; each token's 8 slots
spread uniformly, so a rank computes about as many expert rows as it has tokens), at prefill sizes (4096-16384
tokens) and decode sizes (1-256). FP8 = activations quantized per token per 128 columns + the FP8 GEMM (what
pdserve.ops.fp8_gemm runs); bf16 = F.linear / torch._grouped_mm on the same weights dequantized. Errors are relative
to a float32 product of the same activations and dequantized weights: `rel` = ||out - ref|| / ||ref||, `max` =
max |out - ref| / max |ref|. Needs only torch and triton; about a minute including Triton's compiles.

    python benchmarks/gpu_fp8_gemm.py                # each row: 3 rounds of bf16 then FP8, medians
    python benchmarks/gpu_fp8_gemm.py --prefill-only --rounds 5
    python benchmarks/gpu_fp8_gemm.py --flashinfer   # also flashinfer's SM90 block-scale GEMM on the dense shapes
    TRITON_INTERPRET=1 python benchmarks/gpu_fp8_gemm.py --smoke     # tiny shapes, any device (a check of the script)

`--flashinfer` times `flashinfer.gemm.fp8_blockscale_gemm_sm90` (TensorRT-LLM's DeepGEMM-style kernel, bf16
activations quantized inside, JIT-compiled on first use: ~2 minutes) beside cuBLAS on each dense shape it takes.
"""

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.ops.block_fp8 import BlockFP8Weight, quantize_block_fp8
from pdserve.ops.fp8_gemm import (
    block_fp8_grouped_linear_reference,
    block_fp8_linear_cublas,
    block_fp8_linear_reference,
    block_fp8_linear_triton,
    cublas_takes,
)

V3_DENSE = {"mlp gate/up 7168->18432": (18432, 7168), "o_proj 16384->7168": (7168, 16384),
            "kv_a 7168->576": (576, 7168)}
V3_EXPERTS = {"experts w13 7168->2x2048": (32, 4096, 7168), "experts w2 2048->7168": (32, 7168, 2048)}
PREFILL_TOKENS, DECODE_TOKENS = (4096, 16384), (1, 64, 256)
TOP_K, ALL_EXPERTS = 8, 256


@dataclass
class Row:
    gemm: str
    tokens: int
    flops: float
    bf16_ms: float
    fp8_ms: float
    fp8_kernel: str
    triton_ms: float | None  # Triton's time where the dense dispatch picks cuBLAS
    fp8_rel: float
    fp8_max: float
    bf16_rel: float
    flashinfer_ms: float | None = None  # --flashinfer: its SM90 block-scale GEMM, where it takes the shape
    speedups: tuple[float, float] = (float("nan"), float("nan"))  # lowest and highest bf16/FP8 of one round


def random_fp8(shape: tuple[int, ...], device: torch.device, seed: int) -> BlockFP8Weight:
    gen = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5
    return BlockFP8Weight(*quantize_block_fp8(weight), (128, 128))


def time_ms(fn: Callable[[], torch.Tensor], device: torch.device, min_s: float = 0.05) -> float:
    """Mean time of one call, after two warm-up calls (compiles, caches). On CUDA: replays of a CUDA graph holding
    the call (16 times back to back when it is short), as the engine's decode runs, so launch costs stay out."""
    if device.type != "cuda":
        fn(), fn()
        started, calls = time.perf_counter(), 0
        while time.perf_counter() - started < min_s or calls < 3:
            fn()
            calls += 1
        return (time.perf_counter() - started) / calls * 1e3
    stream = torch.cuda.Stream()  # warm-up off the default stream, as PyTorch asks before a capture
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    eager_s = time.perf_counter() - started
    per_graph = 1 if eager_s > 1e-3 else 16
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    replays = max(3, int(min_s / (eager_s * per_graph)))
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / (replays * per_graph)


def paired_ms(bf16: Callable[[], torch.Tensor], fp8: Callable[[], torch.Tensor], device: torch.device,
              rounds: int) -> tuple[float, float, tuple[float, float]]:
    """bf16's and FP8's median times over `rounds` rounds, each timing one then the other (the GPU's clocks drift
    between runs: a ratio is fairest within a round), and the lowest and highest speed-up of a round."""
    times = [(time_ms(bf16, device), time_ms(fp8, device)) for _ in range(rounds)]
    ratios = [b / f for b, f in times]
    return (statistics.median(b for b, _ in times), statistics.median(f for _, f in times),
            (min(ratios), max(ratios)))


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (out.float() - ref).abs()
    return (diff.norm() / ref.norm()).item(), (diff.max() / ref.abs().max()).item()


def dense_row(name: str, shape: tuple[int, int], tokens: int, device: torch.device, flashinfer: bool = False,
              rounds: int = 1) -> Row:
    weight = random_fp8(shape, device, seed=tokens)
    x = torch.randn(tokens, shape[1], device=device).to(torch.bfloat16)
    bf16_weight = weight.dequantize(torch.bfloat16)
    if device.type == "cuda" and cublas_takes(weight, device):
        fp8, kernel = block_fp8_linear_cublas, "cuBLAS"
    else:
        fp8, kernel = block_fp8_linear_triton, "Triton"
    ref = block_fp8_linear_reference(x.float(), weight)
    fp8_out, bf16_out = fp8(x, weight), F.linear(x, bf16_weight)
    triton_ms = time_ms(lambda: block_fp8_linear_triton(x, weight), device) if kernel == "cuBLAS" else None
    flashinfer_ms = None
    if flashinfer and kernel == "cuBLAS":  # its rules (N a multiple of 64, whole K blocks) hold where cuBLAS's do
        from flashinfer.gemm import fp8_blockscale_gemm_sm90

        def deepgemm() -> torch.Tensor:
            return fp8_blockscale_gemm_sm90(x, weight.values, None, weight.scale_inv)
        deepgemm_rel = errors(deepgemm(), ref)[0]
        if deepgemm_rel > 2 * errors(fp8_out, ref)[0]:
            raise AssertionError(f"flashinfer's block-scale GEMM is off: {deepgemm_rel:.1e} on {name}")
        flashinfer_ms = time_ms(deepgemm, device)
    bf16_ms, fp8_ms, speedups = paired_ms(lambda: F.linear(x, bf16_weight), lambda: fp8(x, weight), device, rounds)
    return Row(name, tokens, 2.0 * tokens * shape[0] * shape[1], bf16_ms=bf16_ms, fp8_ms=fp8_ms,
               fp8_kernel=kernel, triton_ms=triton_ms, fp8_rel=errors(fp8_out, ref)[0], fp8_max=errors(fp8_out, ref)[1],
               bf16_rel=errors(bf16_out, ref)[0], flashinfer_ms=flashinfer_ms, speedups=speedups)


def expert_rows(tokens: int, num_experts: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, group ends) of the rank's share of `tokens` tokens' slots (about `tokens` rows), sorted by
    expert as GroupedMoE sorts them."""
    gen = torch.Generator().manual_seed(tokens)
    rows = max(1, tokens * TOP_K * num_experts // ALL_EXPERTS)
    experts = torch.randint(0, num_experts, (rows,), generator=gen)
    sources = torch.randint(0, tokens, (rows,), generator=gen)
    sorted_experts, order = torch.sort(experts)
    ends = torch.searchsorted(sorted_experts, torch.arange(1, num_experts + 1), right=False).to(torch.int32)
    return sources[order].to(device), ends.to(device)


def grouped_row(name: str, shape: tuple[int, int, int], tokens: int, device: torch.device, rounds: int = 1) -> Row:
    from pdserve.ops.fp8_gemm import block_fp8_grouped_linear_kernels

    weight = random_fp8(shape, device, seed=tokens)
    bf16_weight = weight.dequantize(torch.bfloat16).transpose(1, 2)
    x = torch.randn(tokens, shape[2], device=device).to(torch.bfloat16)
    row_index, ends = expert_rows(tokens, shape[0], device)

    def fp8() -> torch.Tensor:  # block_fp8_grouped_linear's CUDA path, called directly so that --smoke runs it too
        return block_fp8_grouped_linear_kernels(x, weight, ends, row_index)

    def bf16() -> torch.Tensor:
        return torch._grouped_mm(x[row_index], bf16_weight, offs=ends)

    ref = block_fp8_grouped_linear_reference(x.float(), weight, ends, row_index)
    fp8_out = fp8()
    bf16_out = bf16() if device.type == "cuda" else None  # _grouped_mm: bf16 on CUDA
    fp8_rel, fp8_max = errors(fp8_out, ref)
    if bf16_out is not None:
        bf16_ms, fp8_ms, speedups = paired_ms(bf16, fp8, device, rounds)
    else:
        bf16_ms, fp8_ms, speedups = float("nan"), time_ms(fp8, device), (float("nan"), float("nan"))
    return Row(name, tokens, 2.0 * row_index.numel() * shape[1] * shape[2], bf16_ms=bf16_ms, fp8_ms=fp8_ms,
               fp8_kernel=grouped_kernel(weight, row_index.numel(), device), triton_ms=None, fp8_rel=fp8_rel,
               fp8_max=fp8_max, bf16_rel=errors(bf16_out, ref)[0] if bf16_out is not None else float("nan"),
               speedups=speedups)


def grouped_kernel(weight: BlockFP8Weight, rows: int, device: torch.device) -> str:
    """Which kernel block_fp8_grouped_linear runs for these rows."""
    from pdserve.ops import cutlass_fp8
    from pdserve.ops.gemm_triton import tma_takes

    if not tma_takes(weight, rows, device):
        return "Triton"
    if cutlass_fp8.serves(weight.values, weight.block_size, device):
        return "CUTLASS"
    return "Triton TMA"


def print_table(rows: list[Row]) -> None:
    print("| GEMM | tokens | bf16 ms | bf16 TFLOP/s | FP8 ms | FP8 TFLOP/s | FP8 kernel | FP8 speed-up "
          "| speed-up range of a round | Triton ms | flashinfer SM90 ms (speed-up) | FP8 rel err | FP8 max err "
          "| bf16 rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        triton = f"{r.triton_ms:.3f}" if r.triton_ms is not None else "-"
        flashinfer = "-" if r.flashinfer_ms is None else f"{r.flashinfer_ms:.3f} ({r.bf16_ms / r.flashinfer_ms:.2f}x)"
        print(f"| {r.gemm} | {r.tokens} | {r.bf16_ms:.3f} | {r.flops / r.bf16_ms / 1e9:.0f} | {r.fp8_ms:.3f} | "
              f"{r.flops / r.fp8_ms / 1e9:.0f} | {r.fp8_kernel} | {r.bf16_ms / r.fp8_ms:.2f}x | "
              f"{r.speedups[0]:.2f}-{r.speedups[1]:.2f}x | {triton} | "
              f"{flashinfer} | {r.fp8_rel:.2e} | {r.fp8_max:.2e} | {r.bf16_rel:.2e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and sizes (checks the script anywhere)")
    parser.add_argument("--flashinfer", action="store_true",
                        help="dense shapes: also flashinfer's SM90 block-scale GEMM (JIT-compiled on first use)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of bf16 then FP8 timings per row; the table gives their medians")
    parser.add_argument("--prefill-only", action="store_true", help="prefill sizes alone")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dense, experts, sizes = V3_DENSE, V3_EXPERTS, DECODE_TOKENS + PREFILL_TOKENS
    if args.smoke:
        dense, experts, sizes = {"small 300->200": (200, 300)}, {"small experts": (4, 200, 300)}, (1, 40)
    import triton

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    started = time.perf_counter()
    rows = []
    if args.prefill_only:
        sizes = PREFILL_TOKENS
    dense_case = functools.partial(dense_row, flashinfer=args.flashinfer, rounds=args.rounds)
    cases = [(dense_case, gemm, shape) for gemm, shape in dense.items()]
    cases += [(functools.partial(grouped_row, rounds=args.rounds), gemm, shape) for gemm, shape in experts.items()]
    for measure, gemm, shape in cases:
        for tokens in sizes:
            rows.append(measure(gemm, shape, tokens, device))
            print(f"{gemm}, {tokens} tokens: bf16 {rows[-1].bf16_ms:.3f} ms, FP8 {rows[-1].fp8_ms:.3f} ms "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s in all (Triton compiles included)\n")
    print_table(rows)


if __name__ == "__main__":
    main()
