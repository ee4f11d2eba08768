"""Shared-prefix routing: prefill-side prefix-cache hit ratio and mean TTFT under `prefix` and `round_robin` routing,
on the same seeded workload, next to the best ratio that workload allows.

A local cluster of one prefill worker with 4 DP ranks (the router indexes each rank on its own) and one decode
worker, started once per policy. Many groups share a long system prompt; their requests arrive interleaved.

    python benchmarks/prefix_routing.py [--groups 13] [--per-group 6] [--system-prompt-len 512] [--json out.json]
"""

import argparse
import json

from pdserve.bench.client import RunLimits
from pdserve.bench.report import SLO
from pdserve.bench.runner import run_benchmark
from pdserve.bench.workload import LengthRange, WorkloadConfig, best_prefix_hit_ratio, generate_workload
from pdserve.cli.generate import default_model_dir
from pdserve.cluster.local import ClusterConfig, LocalCluster

POLICIES = ("prefix", "round_robin")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the generated tiny model)")
    parser.add_argument("--prefill-ranks", type=int, default=4)
    # 13 groups: not a multiple of 4, so round robin does not send a group to one rank by accident.
    parser.add_argument("--groups", type=int, default=13)
    parser.add_argument("--per-group", type=int, default=6, help="requests per group")
    parser.add_argument("--system-prompt-len", type=int, default=512)
    parser.add_argument("--user-len", default="32,64", help="LOW,HIGH tokens after the system prompt")
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--request-rate", type=float, default=4.0, help="Poisson arrivals per second")
    parser.add_argument("--page-size", type=int, default=16, help="the workers' --page-size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write both results here")
    args = parser.parse_args()

    low, high = (int(part) for part in args.user_len.split(","))
    workload = WorkloadConfig(
        num_requests=args.groups * args.per_group, seed=args.seed, request_rate=args.request_rate,
        prompt_len=LengthRange(low, high), output_len=LengthRange(args.output_tokens, args.output_tokens),
        num_prefix_groups=args.groups, system_prompt_len=args.system_prompt_len,
    )
    best = best_prefix_hit_ratio(generate_workload(workload), args.page_size)
    model = args.model or str(default_model_dir())
    results = {}
    for policy in POLICIES:
        cfg = ClusterConfig(model, port=0, num_prefill=1, num_decode=1, ranks_per_worker=args.prefill_ranks,
                            routing=policy, worker_args=("--page-size", str(args.page_size)))
        with LocalCluster(cfg) as cluster:
            results[policy] = run_benchmark(cluster.url, workload, SLO(ttft_s=2.0, itl_p99_s=0.05),
                                            RunLimits(request_timeout_s=120.0, run_timeout_s=900.0), label=policy)

    print(f"\n{args.groups} groups x {args.per_group} requests, system prompt {args.system_prompt_len} tokens, "
          f"{args.prefill_ranks} prefill ranks, {args.request_rate} req/s")
    print("| routing | prefill prefix-cache hit ratio | best possible | of best | mean TTFT (ms) | failed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for policy, result in results.items():
        summary = result["summary"]
        ratio = summary["prefix_cache_hit_ratio"] or 0.0
        print(f"| {policy} | {ratio:.3f} | {best:.3f} | {ratio / best:.0%} | "
              f"{summary['ttft_s']['mean'] * 1e3:.1f} | {summary['failed']} |")
    prefix_ratio = results["prefix"]["summary"]["prefix_cache_hit_ratio"] or 0.0
    round_robin_ratio = results["round_robin"]["summary"]["prefix_cache_hit_ratio"] or 0.0
    print(f"prefix / round_robin = {prefix_ratio / round_robin_ratio:.2f}x (goal >= 2x); "
          f"prefix / best = {prefix_ratio / best:.2f} (goal >= 0.90)" if round_robin_ratio else "round_robin ratio 0")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"best_possible_hit_ratio": best, "results": results}, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
