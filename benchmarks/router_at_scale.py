"""The router in front of many ranks: simulated prefill and decode workers (pdserve/engine/simulated.py: real
scheduler, pages, prefix cache and KV events; steps sleep what the DeepSeek-V2-Lite H100 profile predicts) in one
in-process cluster, a shared-prefix workload through the real router. Reports how long the router takes to choose
ranks, how much of the best possible prefix reuse its choices get, and what the whole path adds.

    python benchmarks/router_at_scale.py [--prefill-workers 32] [--decode-workers 32] [--ranks 4] [--requests 512]

KV moves between pools by in-process copies (a NIXL agent per rank would keep a thread polling for each of the
hundreds of ranks). All workers, their ranks' step threads and the router share this process (and the machine's
cores) with the load generator; `--sim-time-scale` stretches every simulated step when many ranks would otherwise
queue on the GIL.
"""

import argparse
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.client import RunLimits
from pdserve.bench.report import SLO
from pdserve.bench.runner import run_benchmark
from pdserve.bench.workload import LengthRange, WorkloadConfig, best_prefix_hit_ratio, generate_workload
from pdserve.cli.generate import default_model_dir
from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig

DECISION = "pdserve_router_routing_decision_seconds"


def histogram_buckets(metrics_text: str, name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of one histogram, summed over its label sets."""
    counts: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                bound = float(sample.labels["le"])
                counts[bound] = counts.get(bound, 0.0) + sample.value
    return sorted(counts.items())


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """As Prometheus's histogram_quantile: linear within the bucket that holds the q-th observation."""
    total = buckets[-1][1]
    rank, lower, below = q * total, 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(cumulative - below, 1e-12)
        lower, below = bound, cumulative
    return lower


async def choices_alone(cluster: InProcessCluster, workload: WorkloadConfig) -> list[float]:
    """The router's choice for every prompt of the workload again, timed on its loop once the load has ended: the
    decision alone, with the index and loads the run left, no other thread busy (ms each)."""
    dispatcher = cluster.router.server.config.app.state.parts.serving.dispatcher
    times_ms = []
    for request in generate_workload(workload):
        started = time.perf_counter()
        dispatcher.choose(list(request.prompt_token_ids), set())
        times_ms.append((time.perf_counter() - started) * 1e3)
    return sorted(times_ms)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill-workers", type=int, default=32)
    parser.add_argument("--decode-workers", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=4, help="DP ranks per worker")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--request-rate", type=float, default=32.0, help="Poisson arrivals per second")
    parser.add_argument("--groups", type=int, default=97, help="system prompts shared by the requests")
    parser.add_argument("--system-prompt-len", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--sim-time-scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    workload = WorkloadConfig(
        num_requests=args.requests, seed=args.seed, request_rate=args.request_rate, prompt_len=LengthRange(32, 128),
        output_len=LengthRange(args.output_tokens, args.output_tokens), num_prefix_groups=args.groups,
        system_prompt_len=args.system_prompt_len,
    )
    best = best_prefix_hit_ratio(generate_workload(workload), args.page_size)
    worker_args = ("--engine", "simulated", "--sim-time-scale", str(args.sim_time_scale), "--page-size",
                   str(args.page_size), "--no-warmup", "--num-pages", "4096")
    cfg = ClusterConfig(str(default_model_dir()), port=0, num_prefill=args.prefill_workers,
                        num_decode=args.decode_workers, ranks_per_worker=args.ranks, worker_args=worker_args,
                        start_timeout_s=600.0)
    ranks = (args.prefill_workers + args.decode_workers) * args.ranks
    print(f"starting {args.prefill_workers} prefill + {args.decode_workers} decode workers x {args.ranks} ranks "
          f"({ranks} simulated ranks) in this process ...", flush=True)
    started = time.monotonic()
    with InProcessCluster(cfg, transfer="inprocess") as cluster:
        start_s = time.monotonic() - started
        print(f"cluster up in {start_s:.1f} s; {args.requests} requests at {args.request_rate} req/s ...", flush=True)
        result = run_benchmark(cluster.url, workload, SLO(ttft_s=2.0, itl_p99_s=0.05),
                               RunLimits(request_timeout_s=120.0, run_timeout_s=540.0), label="router-at-scale")
        buckets = histogram_buckets(httpx.get(cluster.url + "/metrics", timeout=30).text, DECISION)
        alone_ms = cluster.run(choices_alone(cluster, workload), 120)
    summary = result["summary"]
    ratio = summary["prefix_cache_hit_ratio"] or 0.0
    print(f"\n{ranks} simulated ranks ({args.prefill_workers * args.ranks} prefill), {args.groups} groups x "
          f"{args.system_prompt_len}-token system prompts, {args.requests} requests at {args.request_rate} req/s, "
          f"time scale {args.sim_time_scale}")
    print("| ranks | cluster start (s) | decisions | decision p50 / p99 in service (ms) | decision p50 / p99 alone (ms) | "
          "prefix hit ratio | best possible | of best | TTFT p50 / p99 (ms) | failed |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    ttft = summary["ttft_s"]
    alone_p50, alone_p99 = alone_ms[len(alone_ms) // 2], alone_ms[int(0.99 * (len(alone_ms) - 1))]
    print(f"| {ranks} | {start_s:.1f} | {buckets[-1][1]:.0f} | {histogram_quantile(buckets, 0.5) * 1e3:.3f} / "
          f"{histogram_quantile(buckets, 0.99) * 1e3:.3f} | {alone_p50:.3f} / {alone_p99:.3f} | {ratio:.3f} | "
          f"{best:.3f} | {ratio / best:.0%} | {ttft['p50'] * 1e3:.0f} / {ttft['p99'] * 1e3:.0f} | {summary['failed']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
