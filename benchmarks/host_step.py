"""The host's share of a decode step: the engine's own work per step (scheduling, launching the sample, resolving the
step before: appending tokens, detokenizing, finishing requests) at a large batch, with the simulated runner, so no
model runs and nothing waits for a device. Under overlapped scheduling this work runs while the GPU computes the step
before; a step whose host work outlasts the GPU's sets the pace (a decode rank in service:
docs/benchmarks.md, "P/D on two H100s").

Requests decode with the tiny generated model's tokenizer from prompts of --context tokens; one in ten is --long
tokens, as in the `mixed` preset. Prints the mean host time per step for each batch size, then (--profile) the
functions that took most of it.

    python benchmarks/host_step.py [--batches 64,256] [--steps 200] [--profile]
"""

import argparse
import cProfile
import pstats
import random
import tempfile
import time

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.model.tiny import make_tiny_model
from pdserve.wire.sampling import SamplingParams


def decoding_engine(model: str, batch: int, context: int, long: int, steps: int) -> Engine:
    """An engine whose `batch` requests have all prefilled and sampled a first token."""
    engine = Engine(EngineConfig(model=model, execution="simulated", time_scale=1e-9, page_size=64,
                                 max_num_seqs=batch, num_pages=batch * (long + steps) // 64 + batch,
                                 max_num_batched_tokens=16384, overlap_scheduling="on", progress=False))
    sampling = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    draw = random.Random(0)
    for i in range(batch):
        length = long if i % 10 == 9 else context
        engine.add_request(f"r{i}", [draw.randrange(3, 500) for _ in range(length)], sampling)
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--long", type=int, default=12000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    model = str(make_tiny_model(tempfile.mkdtemp(), arch="v2", overrides={"max_position_embeddings": 16384}))
    print("| batch | host ms per decode step | tokens/s the host alone could make |")
    print("| ---: | ---: | ---: |")
    profile = cProfile.Profile()
    for batch in (int(b) for b in args.batches.split(",")):
        engine = decoding_engine(model, batch, args.context, args.long, args.steps)
        if args.profile:
            profile.enable()
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step_s = (time.perf_counter() - started) / args.steps
        profile.disable()
        print(f"| {batch} | {step_s * 1e3:.2f} | {batch / step_s:,.0f} |", flush=True)
    if args.profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
