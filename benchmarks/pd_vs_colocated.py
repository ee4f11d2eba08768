"""Colocated against disaggregated on the same machine, model and seeded workload (issue 9's experiment).

Starts each deployment as a local cluster (colocated: 2 `both` workers; disaggregated: 1 prefill + 1 decode;
conditional: the same P/D workers with the router prefilling prompts of at most --local-prefill-max-tokens on the
decode worker while the prefill rank is busy), runs the workload at each request rate, and writes the sweeps as
JSON, a goodput-against-rate plot, latency CDFs at one rate all ran, and comparison tables at that rate.

    python benchmarks/pd_vs_colocated.py [--preset mixed-cpu] [--rates 1,2,4] [--num-requests 40] [--out-dir docs/bench]
"""

import argparse
from dataclasses import replace
from pathlib import Path

from pdserve.bench.client import RunLimits
from pdserve.bench.plot import plot_goodput_vs_rate, plot_latency_cdfs
from pdserve.bench.presets import PRESETS, workload_from_preset
from pdserve.bench.report import SLO, compare_table, write_json
from pdserve.bench.runner import run_benchmark
from pdserve.bench.sweep import SweepConfig, sweep_rates
from pdserve.cli.generate import default_model_dir
from pdserve.cluster.local import ClusterConfig, LocalCluster

PD = dict(num_prefill=1, num_decode=1, num_both=0)
DEPLOYMENTS = {"colocated": dict(num_prefill=0, num_decode=0, num_both=2), "disaggregated": PD, "conditional": PD}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the generated tiny model)")
    parser.add_argument("--preset", choices=tuple(PRESETS), default="mixed-cpu")
    parser.add_argument("--rates", default="1,2,4", help="comma-separated Poisson rates (req/s)")
    parser.add_argument("--compare-rate", type=float, help="rate of the CDF plot and table (default: the lowest)")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-s", type=float, default=2.0)
    parser.add_argument("--slo-itl-p99-s", type=float, default=0.05)
    parser.add_argument("--worker-args", default="", help="extra `pdserve worker` flags, space-separated")
    parser.add_argument("--local-prefill-max-tokens", type=int, default=256, help="the conditional deployment's threshold")
    parser.add_argument("--local-prefill-min-queue", type=int, default=1)
    parser.add_argument("--out-dir", default="bench-out")
    args = parser.parse_args()

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = tuple(float(rate) for rate in args.rates.split(","))
    slo = SLO(args.slo_ttft_s, args.slo_itl_p99_s)
    workload = workload_from_preset(args.preset, num_requests=args.num_requests, seed=args.seed, request_rate=rates[0])
    model = args.model or str(default_model_dir())
    sweeps = {}
    for name, roles in DEPLOYMENTS.items():
        router_args = ("--local-prefill-max-tokens", str(args.local_prefill_max_tokens), "--local-prefill-min-queue",
                       str(args.local_prefill_min_queue)) if name == "conditional" else ()
        cfg = ClusterConfig(model, port=0, worker_args=tuple(args.worker_args.split()), router_args=router_args, **roles)
        with LocalCluster(cfg) as cluster:
            # Warm-up with another seed, so first-call costs (allocations, lazy init) stay out of the figures.
            run_benchmark(cluster.url, replace(workload, seed=args.seed + 1000, num_requests=8, request_rate=None,
                                               max_concurrency=2, long_fraction=0.5), slo, progress=False)
            sweeps[name] = sweep_rates(
                lambda w, name=name, url=cluster.url: run_benchmark(
                    url, w, slo, RunLimits(request_timeout_s=300.0, run_timeout_s=1200.0),
                    label=f"{name} {w.request_rate:g}/s"),
                workload, slo, SweepConfig(rates=rates, max_runs=len(rates)),
            )
        write_json(out_dir / f"{name}.json", sweeps[name])

    plot_goodput_vs_rate({name: sweep["points"] for name, sweep in sweeps.items()}, out_dir / "goodput_vs_rate.png")
    compare_rate = args.compare_rate or rates[0]
    at_rate = {name: next(p["result"] for p in sweep["points"] if p["request_rate"] == compare_rate)
               for name, sweep in sweeps.items()}
    for name, result in at_rate.items():
        result["label"] = name
    plot_latency_cdfs(list(at_rate.values()), out_dir / f"latency_cdf_{compare_rate:g}rps.png")
    print(f"\n{args.preset}, {args.num_requests} requests per rate, SLO TTFT <= {slo.ttft_s} s, "
          f"ITL p99 <= {slo.itl_p99_s} s")
    print("| deployment | rate (req/s) | TTFT p99 (ms) | ITL p99 (ms) | goodput (req/s) | meets SLO |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, sweep in sweeps.items():
        for point in sweep["points"]:
            s = point["summary"]
            print(f"| {name} | {point['request_rate']:g} | {s['ttft_s']['p99'] * 1e3:.0f} | "
                  f"{s['itl_s']['p99'] * 1e3:.1f} | {s['goodput_requests_per_s']:.2f} | {point['meets_slo']} |")
    for name, sweep in sweeps.items():
        print(f"{name}: highest rate meeting the SLO: {sweep['best_rate_meeting_slo']}")
    print(f"\nat {compare_rate:g} req/s:")
    print(compare_table(at_rate["colocated"], at_rate["disaggregated"], "colocated", "disaggregated"))
    print()
    print(compare_table(at_rate["disaggregated"], at_rate["conditional"], "disaggregated", "conditional"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
