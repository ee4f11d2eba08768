"""Weights per expert-parallel rank, FP8 kept vs dequantized to bf16, from a model's config.json (no weights read).

    python benchmarks/weight_memory.py --config /work/shared/models/deepseek-v3.config.json --ranks 1,8,16
"""

import argparse
import json
from pathlib import Path

from pdserve.model.config import ModelConfig
from pdserve.model.weight_memory import rank_weight_bytes

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a DeepSeek config.json")
    parser.add_argument("--ranks", default="1,8,16", help="expert-parallel sizes, comma-separated")
    args = parser.parse_args()
    cfg = ModelConfig.from_dict(json.loads(Path(args.config).read_text()))
    print(f"{args.config}: {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} routed experts, FP8 blocks "
          f"{cfg.fp8_block_size}; per rank, GiB (replicated + routed experts):\n")
    print("| EP ranks | experts per rank | bf16 replicated | bf16 experts | bf16 total | FP8 replicated | FP8 experts "
          "| FP8 total | FP8 / bf16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ranks in (int(r) for r in args.ranks.split(",")):
        bf16 = rank_weight_bytes(cfg, ranks, keep_fp8=False)
        fp8 = rank_weight_bytes(cfg, ranks, keep_fp8=True)
        print(f"| {ranks} | {cfg.n_routed_experts // ranks} | {bf16.replicated / GIB:.1f} | "
              f"{bf16.routed_experts / GIB:.1f} | {bf16.total / GIB:.1f} | {fp8.replicated / GIB:.1f} | "
              f"{fp8.routed_experts / GIB:.1f} | {fp8.total / GIB:.1f} | {fp8.total / bf16.total:.2f} |")


if __name__ == "__main__":
    main()
