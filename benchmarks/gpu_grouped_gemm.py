"""The routed experts' grouped GEMMs at decode sizes in bf16: torch._grouped_mm (cuBLAS) against pdserve's Triton
grouped GEMM, on DeepSeek-V2-Lite's expert shapes (64 experts; each token's 6 slots on distinct experts drawn
uniformly), timed as CUDA-graph replays, next to the read roofline: the chosen experts' weight bytes / HBM read
bandwidth measured in the same run. Errors are relative to a float32 product of the same inputs.

    python benchmarks/gpu_grouped_gemm.py                 # tokens 1..512
"""

import argparse

import torch

from benchmarks.gpu_decode_prefill import hbm_read_bytes_per_s
from benchmarks.gpu_fp8_gemm import errors, time_ms

V2_LITE_EXPERTS = {"w13 2048->2x1408": (64, 2816, 2048), "w2 1408->2048": (64, 2048, 1408)}
TOP_K = 6


def routed_rows(tokens: int, num_experts: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(row index, group ends, distinct experts): every token's slots, sorted by expert as GroupedMoE sorts them."""
    gen = torch.Generator().manual_seed(tokens)
    experts = torch.stack([torch.randperm(num_experts, generator=gen)[:TOP_K] for _ in range(tokens)]).reshape(-1)
    sorted_experts, order = torch.sort(experts)
    ends = torch.searchsorted(sorted_experts, torch.arange(1, num_experts + 1), right=False).to(torch.int32)
    return (order // TOP_K).to(device), ends.to(device), experts.unique().numel()


def main() -> None:
    from pdserve.ops.gemm_triton import bf16_grouped_gemm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512")
    args = parser.parse_args()
    device = torch.device("cuda")
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
