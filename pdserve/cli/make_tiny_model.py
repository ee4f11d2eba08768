"""`pdserve make-tiny-model DIR`: writes a small random DeepSeek checkpoint for tests and demos."""

import argparse

from pdserve.model.tiny import make_tiny_model


def add_make_tiny_model_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("make-tiny-model", help="write a small random DeepSeek-V2/V3 checkpoint")
    parser.add_argument("out_dir", help="directory to write config, tokenizer and safetensors into")
    parser.add_argument("--arch", choices=("v2", "v3"), default="v2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp8", action="store_true", help="store decoder linear weights as block fp8 (V3 style)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--tokenizer", choices=("tiny", "deepseek"), default="tiny",
                        help="tiny: a 512-token BPE trained here; deepseek: DeepSeek's real tokenizer (129,280 rows)")
    parser.set_defaults(func=main_make_tiny_model)


def main_make_tiny_model(args: argparse.Namespace) -> int:
    out_dir = make_tiny_model(
        args.out_dir, arch=args.arch, seed=args.seed, fp8=args.fp8, dtype=args.dtype, num_shards=args.num_shards,
        tokenizer=args.tokenizer,
    )
    print(out_dir)
    return 0
