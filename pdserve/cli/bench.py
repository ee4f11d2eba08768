"""`pdserve bench`: the serving benchmark against a router URL (run, sweep), and comparing two result files."""

import argparse
from pathlib import Path

from pdserve.bench.presets import PRESETS


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="serving benchmark: run, sweep or compare")
    actions = parser.add_subparsers(dest="bench_command", required=True)
    run = actions.add_parser("run", help="replay one workload and write a JSON result (and a CDF plot)")
    _add_target_arguments(run)
    run.set_defaults(func=main_bench_run)
    sweep = actions.add_parser("sweep", help="find the highest request rate that meets the SLO")
    _add_target_arguments(sweep)
    sweep.add_argument("--start-rate", type=float, default=1.0)
    sweep.add_argument("--rates", help="comma-separated rates to run instead of searching")
    sweep.add_argument("--max-runs", type=int, default=8)
    sweep.set_defaults(func=main_bench_sweep)
    compare = actions.add_parser("compare", help="two results side by side")
    compare.add_argument("left")
    compare.add_argument("right")
    compare.add_argument("--plot", help="PNG with both runs' latency CDFs")
    compare.set_defaults(func=main_bench_compare)


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the router, e.g. http://127.0.0.1:8000")
    parser.add_argument("--preset", choices=tuple(PRESETS), default="mixed-cpu")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-rate", type=float, help="Poisson arrivals per second")
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at once")
    parser.add_argument("--prompt-len", help="LOW,HIGH tokens of each user message")
    parser.add_argument("--output-len", help="LOW,HIGH output tokens")
    parser.add_argument("--long-fraction", type=float)
    parser.add_argument("--long-prompt-len", help="LOW,HIGH tokens of long-document prompts")
    parser.add_argument("--prefix-groups", type=int, help="groups sharing a system prompt")
    parser.add_argument("--system-prompt-len", type=int)
    parser.add_argument("--turns", type=int, help="turns per conversation")
    parser.add_argument("--token-id-high", type=int, help="prompt token ids are drawn below this (<= vocab size)")
    parser.add_argument("--slo-ttft-s", type=float, default=2.0)
    parser.add_argument("--slo-itl-p99-s", type=float, default=0.05)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--run-timeout-s", type=float, default=3600.0)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default="bench-result.json", help="JSON result")
    parser.add_argument("--plot", help="PNG plot (latency CDFs; goodput against rate for a sweep)")
    parser.add_argument("--no-progress", action="store_true")


def _length_range(text: str | None):
    from pdserve.bench.workload import LengthRange

    if text is None:
        return None
    low, high = (int(part) for part in text.split(","))
    return LengthRange(low, high)


def _workload(args: argparse.Namespace):
    from pdserve.bench.presets import workload_from_preset

    rate, concurrency = args.request_rate, args.max_concurrency
    if rate is None and concurrency is None and args.bench_command == "run":
        concurrency = 8
    return workload_from_preset(
        args.preset, num_requests=args.num_requests, seed=args.seed, request_rate=rate, max_concurrency=concurrency,
        prompt_len=_length_range(args.prompt_len), output_len=_length_range(args.output_len),
        long_fraction=args.long_fraction, long_prompt_len=_length_range(args.long_prompt_len),
        num_prefix_groups=args.prefix_groups, system_prompt_len=args.system_prompt_len,
        turns_per_conversation=args.turns, token_id_high=args.token_id_high,
    )


def main_bench_run(args: argparse.Namespace) -> int:
    from pdserve.bench.client import RunLimits
    from pdserve.bench.plot import plot_latency_cdfs
    from pdserve.bench.report import SLO, summary_lines, write_json
    from pdserve.bench.runner import require_local, run_benchmark

    require_local(args.url)
    result = run_benchmark(args.url, _workload(args), SLO(args.slo_ttft_s, args.slo_itl_p99_s),
                           RunLimits(args.request_timeout_s, args.run_timeout_s), progress=not args.no_progress,
                           label=args.label)
    write_json(args.out, result)
    if args.plot:
        plot_latency_cdfs([result], args.plot)
    print(summary_lines(result["summary"]))
    print(f"result: {args.out}" + (f", plot: {args.plot}" if args.plot else ""))
    return 0 if result["summary"]["failed"] == 0 else 1


def main_bench_sweep(args: argparse.Namespace) -> int:
    from pdserve.bench.client import RunLimits
    from pdserve.bench.plot import plot_goodput_vs_rate
    from pdserve.bench.report import SLO, write_json
    from pdserve.bench.runner import require_local, run_benchmark
    from pdserve.bench.sweep import SweepConfig, sweep_rates

    require_local(args.url)
    slo, limits = SLO(args.slo_ttft_s, args.slo_itl_p99_s), RunLimits(args.request_timeout_s, args.run_timeout_s)
    rates = tuple(float(r) for r in args.rates.split(",")) if args.rates else ()
    workload = _workload(args)
    sweep = sweep_rates(
        lambda w: run_benchmark(args.url, w, slo, limits, progress=not args.no_progress,
                                label=f"{args.label or 'rate'} {w.request_rate:.3g}/s"),
        workload, slo, SweepConfig(start_rate=args.start_rate, max_runs=args.max_runs, rates=rates),
    )
    sweep["label"] = args.label
    write_json(args.out, sweep)
    if args.plot:
        plot_goodput_vs_rate({args.label or args.url: sweep["points"]}, args.plot)
    for point in sweep["points"]:
        s = point["summary"]
        print(f"rate {point['request_rate']:.3g}/s: {'meets' if point['meets_slo'] else 'misses'} SLO; "
              f"TTFT p99 {s['ttft_s']['p99']}, ITL p99 {s['itl_s']['p99']}, goodput {s['goodput_requests_per_s']:.3g}")
    print(f"highest rate meeting the SLO: {sweep['best_rate_meeting_slo']}")
    return 0


def main_bench_compare(args: argparse.Namespace) -> int:
    from pdserve.bench.report import compare_table, read_json

    left, right = read_json(args.left), read_json(args.right)
    print(compare_table(left, right, left.get("label") or Path(args.left).stem,
                        right.get("label") or Path(args.right).stem))
    if args.plot:
        from pdserve.bench.plot import plot_latency_cdfs

        plot_latency_cdfs([left, right], args.plot)
    return 0


if __name__ == "__main__":  # runnable before `bench` is wired into `pdserve`: python -m pdserve.cli.bench ...
    import sys

    top = argparse.ArgumentParser(prog="pdserve")
    add_bench_parser(top.add_subparsers(dest="command", required=True))
    parsed = top.parse_args(sys.argv[1:])
    sys.exit(parsed.func(parsed))
