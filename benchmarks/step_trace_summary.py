"""Summarises a rank's step trace (`pdserve worker --step-trace PATH`, pdserve/engine/step_trace.py): decode-only steps
grouped by batch size, then prefill-only steps grouped by tokens and by one prompt or several, each with the engine
step, the whole turn of the step loop, the host's wait for the device (overlapped scheduling: the rest of the engine
step is host work) and the garbage collector's time, as percentiles in ms; then the steps that ran more than
--max-batch sequences (past the largest captured graph).

    python benchmarks/step_trace_summary.py $OUT/trace.decode.rank0 [--bucket 32]
    python benchmarks/step_trace_summary.py $OUT/trace.prefill.rank0.gz
"""

import argparse
from collections import defaultdict

from pdserve.bench.report import percentile
from pdserve.engine.step_trace import StepRecord, read_trace

PREFILL_TOKEN_BOUNDS = (1024, 2048, 4096, 8192)  # a row per range up to each bound, and one past the last


def print_table(key: str, extra: str, rows: dict, label, mean_extra) -> None:
    """One row per key of `rows` (sorted), named by `label(key)`; the third column averages `mean_extra(step)`."""
    print(f"| {key} | steps | {extra} | engine p50 / p90 | turn p50 / p99 | device wait p50 | gc ms (max) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in sorted(rows):
        steps = rows[row]
        engine, turn = [r.engine_ms for r in steps], [r.turn_ms for r in steps]
        print(f"| {label(row)} | {len(steps)} | {sum(mean_extra(r) for r in steps) / len(steps):,.0f} "
              f"| {percentile(engine, 50):.1f} / {percentile(engine, 90):.1f} "
              f"| {percentile(turn, 50):.1f} / {percentile(turn, 99):.1f} "
              f"| {percentile([r.wait_ms for r in steps], 50):.1f} | {max(r.gc_ms for r in steps):.1f} |")
    print()


def token_range(tokens: int) -> int:
    """Index of the first bound at or above `tokens` (len(PREFILL_TOKEN_BOUNDS) past the last)."""
    return next((i for i, bound in enumerate(PREFILL_TOKEN_BOUNDS) if tokens <= bound), len(PREFILL_TOKEN_BOUNDS))


def token_range_label(index: int) -> str:
    low = PREFILL_TOKEN_BOUNDS[index - 1] + 1 if index else 1
    return f"{low}-{PREFILL_TOKEN_BOUNDS[index]}" if index < len(PREFILL_TOKEN_BOUNDS) else f"{low}+"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--bucket", type=int, default=32, help="batch sizes per row")
    parser.add_argument("--max-batch", type=int, default=256, help="the largest captured graph")
    args = parser.parse_args()
    records = read_trace(args.trace)
    decodes = [r for r in records if r.shape.decode_batch and not r.shape.prefill_tokens]
    prefills = [r for r in records if r.shape.prefill_tokens and not r.shape.decode_batch]
    span_s = records[-1].t_s - records[0].t_s
    print(f"{args.trace}: {len(records)} steps over {span_s:.1f} s, {len(decodes)} decode-only, {len(prefills)} "
          f"prefill-only; garbage collection {sum(r.gc_ms for r in records):.0f} ms in all\n")
    if decodes:
        by_batch: dict[int, list[StepRecord]] = defaultdict(list)
        for r in decodes:
            by_batch[r.shape.decode_batch // args.bucket * args.bucket].append(r)
        print_table("batch", "mean context", by_batch, lambda low: f"{low}-{low + args.bucket - 1}",
                    lambda r: r.shape.decode_context)
    if prefills:
        by_tokens: dict[tuple[int, bool], list[StepRecord]] = defaultdict(list)
        for r in prefills:
            by_tokens[(token_range(r.shape.prefill_tokens), r.shape.prefill_seqs > 1)].append(r)
        print_table("prefill tokens", "mean tokens", by_tokens,
                    lambda row: f"{token_range_label(row[0])}, {'several prompts' if row[1] else 'one prompt'}",
                    lambda r: r.shape.prefill_tokens)
    beyond = [r for r in decodes if r.shape.decode_batch > args.max_batch]
    if beyond:
        print(f"{len(beyond)} steps ran more than {args.max_batch} sequences (no graph): engine p50 "
              f"{percentile([r.engine_ms for r in beyond], 50):.1f} ms")


if __name__ == "__main__":
    main()
