"""`pdserve generate`: run prompts through the offline engine and print the completions."""

import argparse
import os
import shutil
from pathlib import Path

from pdserve.model.config import model_dir_problem
from pdserve.settings.flags import FlagError
from pdserve.wire.sampling import SamplingParams

DEFAULT_PROMPTS = ["The quick brown fox", "Once upon a time", "A model that serves itself"]


def default_model_dir() -> Path:
    """The tiny model pdserve generates for itself when no --model is given, made once, then reused. It is made
    beside the cache and renamed into place, so a first start stopped halfway (Ctrl-C while the weights are written)
    leaves nothing that looks finished."""
    cache = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "tiny-v2"
    if model_dir_problem(cache) is None:
        return cache
    from pdserve.model.tiny import make_tiny_model  # imports torch (~3 s): only when the model must be made

    partial = cache.with_name(f"{cache.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    make_tiny_model(partial, arch="v2", seed=0)
    if cache.is_dir() and model_dir_problem(cache) is not None:
        shutil.rmtree(cache)  # what an older version left when stopped halfway: its config without weights
    try:
        partial.rename(cache)
    except OSError:  # another process put its model in place first
        shutil.rmtree(partial, ignore_errors=True)
    return cache


def require_servable(model_dir: str, needs_weights: bool = True) -> None:
    """A model directory that cannot be served is a usage error, reported before anything starts."""
    if problem := model_dir_problem(model_dir, needs_weights):
        raise FlagError(f"--model: {problem}")


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate completions offline (no server)")
    parser.add_argument("--model", help="Hugging Face model directory (default: a generated tiny model)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.set_defaults(func=main_generate)


def main_generate(args: argparse.Namespace) -> int:
    from pdserve.engine.llm import LLM

    model = args.model or str(default_model_dir())
    require_servable(model)
    llm = LLM(model, dtype=args.dtype)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    prompts = args.prompt or DEFAULT_PROMPTS
    for prompt, result in zip(prompts, llm.generate(prompts=prompts, sampling=sampling, progress=True)):
        print(f"--- {prompt!r} -> [{result.finish_reason}, {len(result.token_ids)} tokens]\n{prompt}{result.text}")
    return 0
