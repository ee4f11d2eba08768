"""CPU throughput of the engine on a tiny generated model: prefill tokens/s and decode tokens/s at a few batch sizes.

    python benchmarks/cpu_engine.py [--arch v2] [--threads 2]

Prints one table. Figures depend on the machine; compare runs on the same one.
"""

import argparse
import tempfile
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.model.tiny import make_tiny_model


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", choices=("v2", "v3"), default="v2")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = make_tiny_model(tempfile.mkdtemp(), arch=args.arch, overrides={"max_position_embeddings": 16384})
    llm = LLM(str(model_dir), progress=False, dtype="float32", enable_prefix_cache=False,
              max_num_batched_tokens=8192)
    gen = torch.Generator().manual_seed(0)
    llm.generate(prompt_token_ids=[[5] * 64], sampling=SamplingParams(max_tokens=4))  # warm-up
    rows = []
    for prompt_len in (256, 1024, 4096):
        prompt = torch.randint(2, 500, (prompt_len,), generator=gen).tolist()
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        seconds = timed(lambda: llm.generate(prompt_token_ids=[prompt], sampling=one))
        rows.append(("prefill", f"1 x {prompt_len}", prompt_len / seconds, seconds * 1e3))
    for batch in (1, 16, 64):
        prompts = [torch.randint(2, 500, (32,), generator=gen).tolist() for _ in range(batch)]
        steps = 64
        params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
        prefill_only = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        total = timed(lambda: llm.generate(prompt_token_ids=prompts, sampling=params))
        prefill = timed(lambda: llm.generate(prompt_token_ids=prompts, sampling=prefill_only))
        decode_s = max(total - prefill, 1e-9)
        rows.append(("decode", f"{batch} seqs x {steps} steps", batch * steps / decode_s, decode_s / steps * 1e3))
    print(f"tiny {args.arch} model, float32, {args.threads} torch threads")
    print(f"{'phase':8} {'shape':22} {'tokens/s':>10} {'ms per step':>12}")
    for phase, shape, tps, ms in rows:
        print(f"{phase:8} {shape:22} {tps:10.0f} {ms:12.2f}")


if __name__ == "__main__":
    main()
