"""Fits a step profile for the simulated engine to step traces already taken in service (`pdserve worker --step-trace`,
e.g. the decode and prefill traces of a P/D sweep), on a grid chosen to match where those steps fell: a sweep's
decode batches sit at its workload's context, not at the kernel profile's 1k/4k grid. The KV figures (bytes per
token, pool, write rate) are the base profile's.

    python benchmarks/fit_trace_profile.py docs/bench-gpu/pd-h200x2-2026-11-26/*.trace.*.gz \
        --batches 1,2,4,8,16,32,64,128,192 --contexts 2400 --prefill-tokens 1,1024,1536,2048,4096,8192 \
        --every-prefill-step --out profile.json     # pdserve/engine/profiles/v2-lite-h200-pd-service.json
"""

import argparse
import json
from pathlib import Path

from pdserve.engine.profile_fit import FitGrid, fit_profile
from pdserve.engine.step_profile import DEFAULT_PROFILE, StepProfile
from pdserve.engine.step_trace import read_trace


def numbers(text: str, kind=int) -> tuple:
    return tuple(kind(value) for value in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--batches", required=True, help="decode batch points, ascending")
    parser.add_argument("--contexts", required=True, help="decode mean-context points, ascending")
    parser.add_argument("--prefill-tokens", required=True, help="prefill points (tokens of one prompt's chunk)")
    parser.add_argument("--every-prefill-step", action="store_true", help="prefill points from steps of several "
                        "prompts too, by their tokens (a loaded P/D prefill worker), not one prompt's chunk alone")
    parser.add_argument("--base", default=str(DEFAULT_PROFILE), help="profile whose KV figures are kept")
    parser.add_argument("--name", default="fitted to step traces taken in service")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    records = [record for path in args.traces for record in read_trace(path)]
    base = StepProfile.load(args.base)
    grid = FitGrid(numbers(args.batches), numbers(args.contexts, float), numbers(args.prefill_tokens))
    source = "step traces: " + ", ".join(Path(p).name for p in args.traces)
    if args.every_prefill_step:
        source += "; prefill points from every prefill-only step, several prompts' too"
    fit = fit_profile(records, base, grid, args.name, source, args.every_prefill_step)
    Path(args.out).write_text(json.dumps(fit.profile, indent=1) + "\n")
    decode = fit.profile["decode_ms"]
    print(f"{len(records)} steps; decode ms (rows: batch, columns: context {decode['contexts']}):")
    for batch, row, samples in zip(decode["batches"], decode["ms"], fit.profile["samples"]["decode"]):
        print(f"  {batch:>4}: " + ", ".join(f"{ms:.2f} ({n} steps)" for ms, n in zip(row, samples)))
    prefill = fit.profile["prefill_ms"]
    print("prefill ms: " + ", ".join(f"{t} tokens {ms:.1f}" for t, ms in zip(prefill["tokens"], prefill["ms"])))
    for line in fit.missing + fit.notes:
        print(f"  {line}")
    print(f"profile: {args.out}")


if __name__ == "__main__":
    main()
