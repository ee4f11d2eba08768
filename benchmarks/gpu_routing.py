"""Routing of one MoE layer (float32 gate GEMV, scores, top-k, weights) as the compiled layer regions run it: the
few-token path (GEMV and top-k as fused reductions) against the sort path (cuBLAS GEMV + torch.topk), with the
gate weight in float32 (as loaded) and in bf16 (converted each call, as before). Each call is timed as replays of a
CUDA graph holding 50 calls, so the figure includes the gaps between its kernels, as in the decode graphs.

    python3 benchmarks/gpu_routing.py          # DeepSeek-V2-Lite's router, tokens 1-64 (--config: another model's)
"""

import argparse
import json
from pathlib import Path

import torch

from pdserve.model import deepseek
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek import TopkRouter
from pdserve.ops.token_dynamic import compile_token_dynamic

V2_LITE = Path(__file__).resolve().parents[1] / "pdserve" / "model" / "configs" / "deepseek-v2-lite.json"
CALLS_PER_GRAPH = 50


def us_per_call(fn, x: torch.Tensor) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn(x)
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1e3 / (20 * CALLS_PER_GRAPH)


def compiled_router(router: TopkRouter, few_max_tokens: int):
    """The router compiled as a layer region is, with the few-token path up to `few_max_tokens` (0: never)."""
    deepseek.FUSED_ROUTING_MAX_TOKENS = few_max_tokens  # read while tracing, so each compile keeps its own
    torch._dynamo.reset()
    return compile_token_dynamic(router)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(V2_LITE))
    parser.add_argument("--tokens", default="1,2,4,16,64")
    args = parser.parse_args()
    device = torch.device("cuda")
    cfg = ModelConfig.from_dict(json.loads(Path(args.config).read_text()))
    few_max = deepseek.FUSED_ROUTING_MAX_TOKENS
    routers = {}
    for dtype in (torch.float32, torch.bfloat16):
        router = TopkRouter(cfg).to(device)
        torch.nn.init.normal_(router.weight, std=cfg.hidden_size ** -0.5, generator=torch.Generator(device).manual_seed(0))
        routers[dtype] = router.to(dtype).requires_grad_(False)
        if cfg.scoring_func == "sigmoid":
            router.e_score_correction_bias = router.e_score_correction_bias.float()
    print(f"device {torch.cuda.get_device_name()}, {cfg.n_routed_experts} experts, top {cfg.num_experts_per_tok}, "
          f"hidden {cfg.hidden_size}; few-token path up to {few_max} tokens", flush=True)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, cfg.hidden_size, device=device).to(torch.bfloat16)
        with torch.inference_mode():
            times = {}
            for name, dtype, limit in (("few-token, float32 weight", torch.float32, few_max),
                                       ("sort, float32 weight", torch.float32, 0),
                                       ("sort, bf16 weight (before)", torch.bfloat16, 0)):
                eager_ids = routers[dtype](x)[0].sort(dim=-1).values  # each router against itself, uncompiled
                fn = compiled_router(routers[dtype], limit)
                times[name + " same ids"] = torch.equal(fn(x)[0].sort(dim=-1).values, eager_ids)
                times[name] = us_per_call(fn, x)
        rows.append((tokens, times))
    names = [n for n in rows[0][1] if not n.endswith("same ids")]
    print("| tokens | " + " | ".join(f"{n} (us)" for n in names) + " | same experts as uncompiled |")
    print("| ---: | " + " | ".join("---:" for _ in names) + " | --- |")
    for tokens, times in rows:
        same = all(times[n + " same ids"] for n in names)
        print(f"| {tokens} | " + " | ".join(f"{times[n]:.2f}" for n in names) + f" | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
