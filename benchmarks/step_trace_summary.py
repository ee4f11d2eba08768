"""Summarises a rank's step trace (`pdserve worker --step-trace PATH`, pdserve/engine/step_trace.py): decode-only steps
grouped by batch size, with the engine step, the whole turn of the step loop, the host's wait for the device
(overlapped scheduling: the rest of the engine step is host work) and the garbage collector's time, as percentiles in
ms; then the steps that ran more than --max-batch sequences (past the largest captured graph).

    python benchmarks/step_trace_summary.py $OUT/trace.decode.rank0 [--bucket 32]
"""

import argparse
from collections import defaultdict

from pdserve.bench.report import percentile
from pdserve.engine.step_trace import StepRecord, read_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--bucket", type=int, default=32, help="batch sizes per row")
    parser.add_argument("--max-batch", type=int, default=256, help="the largest captured graph")
    args = parser.parse_args()
    records = read_trace(args.trace)
    decodes = [r for r in records if r.shape.decode_batch and not r.shape.prefill_tokens]
    span_s = records[-1].t_s - records[0].t_s
    print(f"{args.trace}: {len(records)} steps over {span_s:.1f} s, {len(decodes)} decode-only; garbage collection "
          f"{sum(r.gc_ms for r in records):.0f} ms in all\n")
    rows: dict[int, list[StepRecord]] = defaultdict(list)
    for r in decodes:
        rows[r.shape.decode_batch // args.bucket * args.bucket].append(r)
    print("| batch | steps | mean context | engine p50 / p90 | turn p50 / p99 | device wait p50 | gc ms (max) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for low in sorted(rows):
        steps = rows[low]
        engine, turn = [r.engine_ms for r in steps], [r.turn_ms for r in steps]
        context = sum(r.shape.decode_context for r in steps) / len(steps)
        print(f"| {low}-{low + args.bucket - 1} | {len(steps)} | {context:,.0f} "
              f"| {percentile(engine, 50):.1f} / {percentile(engine, 90):.1f} "
              f"| {percentile(turn, 50):.1f} / {percentile(turn, 99):.1f} "
              f"| {percentile([r.wait_ms for r in steps], 50):.1f} | {max(r.gc_ms for r in steps):.1f} |")
    beyond = [r for r in decodes if r.shape.decode_batch > args.max_batch]
    if beyond:
        print(f"\n{len(beyond)} steps ran more than {args.max_batch} sequences (no graph): engine p50 "
              f"{percentile([r.engine_ms for r in beyond], 50):.1f} ms")


if __name__ == "__main__":
    main()
