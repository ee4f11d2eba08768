"""The routed experts' grouped GEMMs at decode sizes in bf16: torch._grouped_mm (cuBLAS) against pdserve's Triton
grouped GEMM, on DeepSeek-V2-Lite's expert shapes (64 experts; each token's 6 slots on distinct experts drawn
uniformly), timed as CUDA-graph replays, next to the read roofline: the chosen experts' weight bytes / HBM read
bandwidth measured in the same run. Errors are relative to a float32 product of the same inputs.

At prefill sizes (`--prefill`) the GEMMs are compute-bound: the same shapes at 1k-8k tokens, and DeepSeek-V3's FP8
experts of one EP8 rank at 4k-16k tokens, in TFLOP/s, cuBLAS against the Triton kernel at each tiling of a sweep.

    python benchmarks/gpu_grouped_gemm.py                 # tokens 1..512
    python benchmarks/gpu_grouped_gemm.py --prefill       # tokens 1k..16k, tilings swept
    python benchmarks/gpu_grouped_gemm.py --sort          # the experts' sort of routed rows: counting vs radix
    python benchmarks/gpu_grouped_gemm.py --prefill --fp8-only --v3-tokens 16384 --tiles 64x128/4/3 --diagnose
    python benchmarks/gpu_grouped_gemm.py --prefill --fp8-only --v3-tokens 4096,16384 --tiles 64x128/4/3 --rounds 7

FP8 lines: first the path GroupedMoE takes (block_fp8_grouped_linear: at these sizes the rows gathered while they are
quantized, then CUTLASS's grouped kernel on SM90 where it builds), then our Triton TMA kernel on the same rows, then
the Triton pointer kernel (gathering rows inside) at each tiling of the sweep.
For the down projection (w2) three more lines take the activation along, from gate_up [rows, 2 x 2048] sorted by
expert: bf16 (the compiled weighted SiLU-and-mul, then cuBLAS: the baseline of their speed-up column), FP8 with the
activation written in bf16 then quantized (GroupedMoE's path before the fusion), and FP8 with the activation fused
into the quantization (silu_and_mul_quantize, GroupedMoE's path at these sizes); errors against the float32 product
of the float32 activations.
`--diagnose` adds, for each tiling, the pointer kernel on rows gathered beforehand (what the in-kernel gather costs)
and without the per-block scale step (what applying the scales costs; its output is not a product, so no error is
printed), and the quantization with its gather alone.
"""

import argparse

import torch

from benchmarks.gpu_fp8_gemm import V3_EXPERTS, errors, expert_rows, grouped_kernel, paired_ms, random_fp8, time_ms
from pdserve.ops.block_fp8 import BlockFP8Weight

V2_LITE_EXPERTS = {"w13 2048->2x1408": (64, 2816, 2048), "w2 1408->2048": (64, 2048, 1408)}
V3_DOWN = "experts w2 2048->7168"  # the V3_EXPERTS entry whose input is the activation of gate_up
TOP_K = 6
PREFILL_TOKENS, V3_PREFILL_TOKENS = (1024, 2048, 4096, 8192), (4096, 16384)
# (block_m, block_n, warps, stages) of pdserve.ops.gemm_triton.GemmTiles
TILE_SWEEP = ((64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 3), (128, 256, 8, 3))


def routed_rows(tokens: int, num_experts: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(row index, group ends, distinct experts): every token's slots, sorted by expert as GroupedMoE sorts them."""
    gen = torch.Generator().manual_seed(tokens)
    experts = torch.stack([torch.randperm(num_experts, generator=gen)[:TOP_K] for _ in range(tokens)]).reshape(-1)
    sorted_experts, order = torch.sort(experts)
    ends = torch.searchsorted(sorted_experts, torch.arange(1, num_experts + 1), right=False).to(torch.int32)
    return (order // TOP_K).to(device), ends.to(device), experts.unique().numel()


def sweep_line(name: str, tokens: int, rows: int, kernel: str, flops: float, cublas_us: float | None,
               run, ref: torch.Tensor | None, device: torch.device) -> float:
    """One kernel's line of the prefill table (`cublas_us` None: this is the cuBLAS line; `ref` None: no error, the
    output is not the product); returns its time. A tiling that does not fit the SM's shared memory prints as such."""
    try:
        us = time_ms(run, device) * 1e3
    except Exception as error:  # triton's OutOfResources and kin: the tiling is not launchable on this GPU
        print(f"| {name} | {tokens} | {rows} | {kernel} | - | - | - | {type(error).__name__} |", flush=True)
        return float("nan")
    error = "-" if ref is None else f"{errors(run(), ref)[0]:.1e}"
    print(f"| {name} | {tokens} | {rows} | {kernel} | {us:.1f} | {flops / us / 1e6:.0f} | "
          f"{(cublas_us or us) / us:.2f}x | {error} |", flush=True)
    return us


def parse_tiles(text: str) -> tuple[tuple[int, int, int, int], ...]:
    """"64x128/4/3,128x128/8/3" -> ((64, 128, 4, 3), (128, 128, 8, 3))."""
    tilings = []
    for item in text.split(","):
        size, warps, stages = item.split("/")
        block_m, block_n = size.split("x")
        tilings.append((int(block_m), int(block_n), int(warps), int(stages)))
    return tuple(tilings)


def prefill_sweep(device: torch.device, bf16: bool = True, tilings: tuple[tuple[int, int, int, int], ...] = TILE_SWEEP,
                  v3_tokens: tuple[int, ...] = V3_PREFILL_TOKENS, diagnose: bool = False, rounds: int = 1) -> None:
    """bf16 V2-Lite experts (unless `bf16` is off) and FP8 V3 EP8 experts at prefill sizes: cuBLAS (with and without
    the row gather the MoE layer needs before it) against the Triton kernels: bf16 at its default tiling and each of
    `tilings`; FP8 as served, then the pointer kernel at each of `tilings` (`diagnose`: see the module's notes)."""
    from pdserve.ops.fp8_gemm import block_fp8_grouped_linear_kernels, block_fp8_grouped_linear_reference
    from pdserve.ops.gemm_triton import (GemmTiles, _grouped_gemm, bf16_grouped_gemm, fp8_gemm, grouped_fp8_gemm_tma,
                                         quantize_rows, tiles_for)

    sweep = tuple(GemmTiles(*tiles) for tiles in tilings)

    print(f"device: {torch.cuda.get_device_name(device)}; tiles: block_m x block_n / warps / stages")
    print("| GEMM | tokens | rows | kernel | us | TFLOP/s | vs cuBLAS with gather | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (experts, n, k) in V2_LITE_EXPERTS.items() if bf16 else ():
        gen = torch.Generator(device=device).manual_seed(n)
        weight = (torch.randn(experts, n, k, generator=gen, device=device) * k**-0.5).to(torch.bfloat16)
        for tokens in PREFILL_TOKENS:
            x = torch.randn(tokens, k, generator=gen, device=device).to(torch.bfloat16)
            row_index, ends, _ = routed_rows(tokens, experts, device)
            rows, gathered = row_index.numel(), x[row_index]
            flops = 2.0 * rows * n * k
            ref = torch.cat([gathered[a:b].float() @ weight[e].float().T for e, (a, b) in
                             enumerate(zip([0] + ends.tolist()[:-1], ends.tolist()))])
            cublas_us = sweep_line(name, tokens, rows, "cuBLAS + gather", flops, None,
                                   lambda: torch._grouped_mm(x[row_index], weight.transpose(1, 2), offs=ends), ref,
                                   device)
            sweep_line(name, tokens, rows, "cuBLAS, rows gathered", flops, cublas_us,
                       lambda: torch._grouped_mm(gathered, weight.transpose(1, 2), offs=ends), ref, device)
            default = tiles_for(rows / experts)
            for tiles in (default,) + tuple(t for t in sweep if t != default):
                label = f"Triton {tiles.block_m}x{tiles.block_n}/{tiles.warps}/{tiles.stages}"
                sweep_line(name, tokens, rows, label + (" (default)" if tiles == default else ""), flops, cublas_us,
                           lambda tiles=tiles: bf16_grouped_gemm(x, weight, ends, row_index, tiles), ref, device)
    for name, shape in V3_EXPERTS.items():
        weight = random_fp8(shape, device, seed=shape[1])
        bf16_weight = weight.dequantize(torch.bfloat16).transpose(1, 2)
        for tokens in v3_tokens:
            x = torch.randn(tokens, shape[2], device=device).to(torch.bfloat16)
            row_index, ends = expert_rows(tokens, shape[0], device)
            rows = row_index.numel()
            flops = 2.0 * rows * shape[1] * shape[2]
            ref = block_fp8_grouped_linear_reference(x.float(), weight, ends, row_index)
            cublas_us = sweep_line(name, tokens, rows, "bf16 cuBLAS + gather", flops, None,
                                   lambda: torch._grouped_mm(x[row_index], bf16_weight, offs=ends), ref, device)
            sweep_line(name, tokens, rows, f"FP8 as served: quantize + gather, {grouped_kernel(weight, rows, device)}",
                       flops, cublas_us, lambda: block_fp8_grouped_linear_kernels(x, weight, ends, row_index), ref,
                       device)

            def triton_tma() -> torch.Tensor:
                q, scales = quantize_rows(x, 128, row_index=row_index)
                return grouped_fp8_gemm_tma(q, scales, weight.values, weight.scale_inv, ends, 128)
            sweep_line(name, tokens, rows, "FP8 quantize + gather, Triton TMA", flops, cublas_us, triton_tma, ref,
                       device)
            for tiles in sweep:  # the pointer kernel, gathering inside
                def fp8(tiles=tiles) -> torch.Tensor:
                    q, scales = quantize_rows(x, 128)
                    return fp8_gemm(q, scales, weight, rows=rows, group_ends=ends, row_index=row_index, tiles=tiles)
                label = f"FP8 pointer kernel {tiles.block_m}x{tiles.block_n}/{tiles.warps}/{tiles.stages}"
                sweep_line(name, tokens, rows, label, flops, cublas_us, fp8, ref, device)
                if not diagnose:
                    continue
                gathered_q, gathered_scales = quantize_rows(x, 128, row_index=row_index)
                sweep_line(name, tokens, rows, label + ", rows gathered before", flops, cublas_us,
                           lambda tiles=tiles: fp8_gemm(gathered_q, gathered_scales, weight, rows=rows, group_ends=ends,
                                                        tiles=tiles), ref, device)
                q, _ = quantize_rows(x, 128)
                sweep_line(name, tokens, rows, label + ", no scale step", flops, cublas_us,
                           lambda tiles=tiles: _grouped_gemm(q, weight.values, rows, ends, row_index, torch.bfloat16,
                                                             128, None, tiles), None, device)
            if diagnose:
                sweep_line(name, tokens, rows, "quantize_rows with the gather, alone", flops, cublas_us,
                           lambda: quantize_rows(x, 128, row_index=row_index)[0], None, device)
            if name == V3_DOWN:
                activation_lines(name, tokens, weight, bf16_weight, ends, rows, device, rounds)


def activation_lines(name: str, tokens: int, weight: BlockFP8Weight, bf16_weight: torch.Tensor, ends: torch.Tensor,
                     rows: int, device: torch.device, rounds: int = 1) -> None:
    """The down projection with the activation before it, from gate_up rows sorted by expert: bf16 (the baseline of
    the lines' speed-up column), FP8 from bf16 activations, FP8 from the fused activation-quantization; with
    `rounds` > 1, one more line: the bf16 and fused FP8 steps timed in that many alternating rounds (medians)."""
    from pdserve.ops.fp8_gemm import (
        block_fp8_grouped_linear_kernels,
        block_fp8_grouped_linear_quantized,
        block_fp8_grouped_linear_reference,
    )
    from pdserve.ops.gemm_triton import silu_and_mul_quantize
    from pdserve.ops.moe_grouped import fused_weighted_silu_and_mul

    inter = weight.shape[2]
    gate_up = torch.randn(rows, 2 * inter, device=device).to(torch.bfloat16)
    weights = torch.rand(rows, device=device)
    gate, up = gate_up.float().chunk(2, dim=-1)
    ref = block_fp8_grouped_linear_reference(torch.nn.functional.silu(gate) * up * weights[:, None], weight, ends)
    del gate, up
    activation = fused_weighted_silu_and_mul()
    activation(gate_up, weights)  # compiled here, before the timed calls
    flops = 2.0 * rows * weight.shape[1] * inter
    bf16_us = sweep_line(name, tokens, rows, "bf16 SiLU-and-mul + cuBLAS", flops, None,
                         lambda: torch._grouped_mm(activation(gate_up, weights), bf16_weight, offs=ends), ref, device)
    sweep_line(name, tokens, rows, "FP8 SiLU-and-mul, then quantize + " + grouped_kernel(weight, rows, device), flops,
               bf16_us, lambda: block_fp8_grouped_linear_kernels(activation(gate_up, weights), weight, ends), ref,
               device)
    def fused() -> torch.Tensor:
        return block_fp8_grouped_linear_quantized(*silu_and_mul_quantize(gate_up, weights, 128), weight, ends)

    kernel = grouped_kernel(weight, rows, device)
    sweep_line(name, tokens, rows, "FP8 SiLU-and-mul fused with quantize + " + kernel, flops, bf16_us, fused, ref,
               device)
    if rounds > 1:
        bf16_ms, fp8_ms, (low, high) = paired_ms(
            lambda: torch._grouped_mm(activation(gate_up, weights), bf16_weight, offs=ends), fused, device, rounds)
        print(f"| {name} | {tokens} | {rows} | bf16 then fused FP8 ({kernel}), {rounds} rounds: medians "
              f"{bf16_ms * 1e3:.1f} / {fp8_ms * 1e3:.1f} us, range of a round {low:.2f}-{high:.2f}x | "
              f"{fp8_ms * 1e3:.1f} | {flops / fp8_ms / 1e9:.0f} | {bf16_ms / fp8_ms:.2f}x | - |", flush=True)


def sort_times(device: torch.device) -> None:
    """The routed rows' sort by expert (V2-Lite: 64 experts, 6 a token), as the compiled experts run it: the counting
    sort compiled by inductor against the radix sort (torch.sort + searchsorted), each captured in a CUDA graph."""
    from pdserve.ops.moe_grouped import counting_sort, radix_sort
    from pdserve.ops.token_dynamic import compile_token_dynamic

    experts = V2_LITE_EXPERTS["w13 2048->2x1408"][0]
    counting, radix = compile_token_dynamic(counting_sort), compile_token_dynamic(radix_sort)
    print(f"device: {torch.cuda.get_device_name(device)}")
    print("| tokens | rows | radix sort us | counting sort (compiled) us | radix / counting |")
    print("|---|---|---|---|---|")
    for tokens in (1, 16, 64, 256, 341, 512, 1024, 2048):
        gen = torch.Generator().manual_seed(tokens)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:TOP_K] for _ in range(tokens)]).reshape(-1)
        ids = ids.to(device)
        radix_us = time_ms(lambda: radix(ids, experts)[0], device) * 1e3
        counting_us = time_ms(lambda: counting(ids, experts)[0], device) * 1e3
        assert torch.equal(ids[counting(ids, experts)[0]], ids[radix(ids, experts)[0]])
        print(f"| {tokens} | {ids.numel()} | {radix_us:.1f} | {counting_us:.1f} | {radix_us / counting_us:.2f}x |",
              flush=True)


def main() -> None:
    from pdserve.ops.gemm_triton import bf16_grouped_gemm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512")
    parser.add_argument("--prefill", action="store_true", help="prefill sizes, tilings swept (TFLOP/s)")
    parser.add_argument("--fp8-only", action="store_true", help="--prefill: the FP8 V3 experts alone")
    parser.add_argument("--tiles", type=parse_tiles, default=TILE_SWEEP,
                        help="--prefill: tilings swept, as block_m x block_n / warps / stages, comma-separated")
    parser.add_argument("--v3-tokens", default=",".join(map(str, V3_PREFILL_TOKENS)),
                        help="--prefill: tokens of the FP8 V3 expert GEMMs")
    parser.add_argument("--diagnose", action="store_true",
                        help="--prefill: FP8 also with rows gathered before, without the scale step, and "
                             "quantizing alone")
    parser.add_argument("--rounds", type=int, default=1,
                        help="--prefill: also time the w2 step with its activation in alternating rounds, bf16 then "
                             "fused FP8 (medians)")
    parser.add_argument("--sort", action="store_true", help="the routed rows' sort: counting against radix")
    args = parser.parse_args()
    device = torch.device("cuda")
    if args.prefill:
        prefill_sweep(device, bf16=not args.fp8_only, tilings=args.tiles,
                      v3_tokens=tuple(int(t) for t in args.v3_tokens.split(",")), diagnose=args.diagnose,
                      rounds=args.rounds)
        return
    if args.sort:
        sort_times(device)
        return
    from benchmarks.gpu_decode_prefill import hbm_read_bytes_per_s  # the engine's imports: not for --prefill/--sort

    bytes_per_s = hbm_read_bytes_per_s(device, 4.0)
    print(f"device: {torch.cuda.get_device_name(device)}; HBM read {bytes_per_s / 1e12:.2f} TB/s")
    print("| GEMM | tokens | rows | experts read | roofline us | cuBLAS grouped us | Triton us | Triton speed-up | "
          "Triton / roofline | cuBLAS rel err | Triton rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (experts, n, k) in V2_LITE_EXPERTS.items():
        gen = torch.Generator(device=device).manual_seed(n)
        weight = (torch.randn(experts, n, k, generator=gen, device=device) * k**-0.5).to(torch.bfloat16)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, k, generator=gen, device=device).to(torch.bfloat16)
            row_index, ends, distinct = routed_rows(tokens, experts, device)
            bounds = [0] + ends.tolist()
            ref = torch.cat([x[row_index[a:b]].float() @ weight[e].float().T for e, (a, b) in
                             enumerate(zip(bounds[:-1], bounds[1:]))])

            def cublas() -> torch.Tensor:
                return torch._grouped_mm(x[row_index], weight.transpose(1, 2), offs=ends)

            def triton() -> torch.Tensor:
                return bf16_grouped_gemm(x, weight, ends, row_index)

            roofline_us = distinct * n * k * 2 / bytes_per_s * 1e6
            cublas_us, triton_us = time_ms(cublas, device) * 1e3, time_ms(triton, device) * 1e3
            print(f"| {name} | {tokens} | {row_index.numel()} | {distinct} | {roofline_us:.1f} | {cublas_us:.1f} | "
                  f"{triton_us:.1f} | {cublas_us / triton_us:.2f}x | {roofline_us / triton_us:.0%} | "
                  f"{errors(cublas(), ref)[0]:.1e} | {errors(triton(), ref)[0]:.1e} |", flush=True)


if __name__ == "__main__":
    main()
