"""The SLO planner against fixed pool sizes over a bursty, day-shaped trace, on simulated workers.

One deployment per invocation (`run`): a scalable in-process cluster of simulated prefill and decode workers
(pdserve/engine/simulated.py, one DP rank each, KV between pools by in-process copies) behind the real router, and
either the planner (pdserve/planner/) starting and draining workers as the traffic goes, or fixed pools. The trace
compresses a day into `--hour-s` simulated seconds per hour: Poisson arrivals whose rate follows a daily curve (a
night trough, a morning ramp, an afternoon peak) with two bursts. `plot` reads the runs and draws docs/ plots and the
table of SLO attainment and GPU-hours.

    python benchmarks/planner_day_trace.py run --policy planner --out /tmp/day
    python benchmarks/planner_day_trace.py run --policy fixed --prefill 2 --decode 1 --out /tmp/day
    python benchmarks/planner_day_trace.py plot /tmp/day/*.json --out-dir docs/planner

Every simulated step sleeps `--sim-time-scale` times its profiled time so that the load fits this machine's cores;
the benchmark reports in simulated time (wall / scale). The planner sees wall time, so it is given the profile and
its SLO, intervals and start delay multiplied by the scale: it plans the cluster as it runs here.
"""

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import threading
import time
from pathlib import Path

from pdserve.bench.client import RunLimits, run_workload
from pdserve.bench.presets import workload_from_preset
from pdserve.bench.report import SLO, percentile
from pdserve.bench.workload import LengthRange, generate_workload
from pdserve.cli.generate import default_model_dir
from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig
from pdserve.engine.step_profile import DEFAULT_PROFILE, StepProfile
from pdserve.planner.config import PlannerConfig
from pdserve.planner.loop import router_urls_now, run_planner
from pdserve.planner.policy import Planner
from pdserve.planner.pools import ClusterPools, role_of

HOURS = 24
# Two bursts on top of the daily curve: (start hour, length in hours, rate multiplier).
BURSTS = ((10.0, 0.5, 1.8), (16.5, 0.75, 1.6))


def day_rate(hour: float, peak: float, trough_share: float) -> float:
    """Requests per (simulated) second at `hour`: lowest at 04:00, highest at 16:00, with the bursts."""
    daily = 0.5 - 0.5 * math.cos(2 * math.pi * (hour - 4.0) / HOURS)
    rate = peak * (trough_share + (1 - trough_share) * daily ** 1.5)
    for start, length, multiplier in BURSTS:
        if start <= hour < start + length:
            rate *= multiplier
    return rate


def arrivals(peak: float, trough_share: float, hour_s: float, seed: int) -> list[float]:
    """Arrival times (simulated seconds) of a Poisson process following day_rate, by thinning."""
    rng = random.Random(seed)
    top = peak * max(m for _, _, m in BURSTS)
    times, t = [], 0.0
    while True:
        t += rng.expovariate(top)
        if t >= HOURS * hour_s:
            return times
        if rng.random() * top <= day_rate(t / hour_s, peak, trough_share):
            times.append(t)


def scaled_profile(profile: StepProfile, scale: float) -> StepProfile:
    """The profile as the planner sees this cluster run: every step `scale` times longer, KV writes as much slower."""
    return dataclasses.replace(
        profile, decode_ms=[[ms * scale for ms in row] for row in profile.decode_ms],
        prefill_ms=[ms * scale for ms in profile.prefill_ms], kv_write_gb_per_s=profile.kv_write_gb_per_s / scale)


def sample_pools(cluster: InProcessCluster, pools: ClusterPools | None, stop: threading.Event, period_s: float,
                 started: float, samples: list[dict]) -> None:
    """Workers held (serving, starting or draining: each holds its GPU) over wall time."""
    while not stop.wait(period_s):
        held = {"prefill": 0, "decode": 0}
        for worker in list(cluster.workers):
            held[role_of(worker)] += 1
        if pools is not None:
            for role, starting in pools.starting().items():
                held[role] += starting
        samples.append({"wall_s": time.monotonic() - started, **held})


def run(args: argparse.Namespace) -> None:
    scale = args.sim_time_scale
    profile_path = args.profile or str(DEFAULT_PROFILE)
    profile = StepProfile.load(profile_path)
    times = arrivals(args.peak_rate, args.trough_share, args.hour_s, args.seed)
    workload = workload_from_preset(args.preset, num_requests=len(times), request_rate=1.0, seed=args.seed,
                                    output_len=LengthRange(*args.output_len))
    requests = [dataclasses.replace(r, arrival_s=t * scale) for r, t in zip(generate_workload(workload), times)]
    planning = args.policy == "planner"
    cfg = ClusterConfig(
        model=args.model or str(default_model_dir()), port=0, scalable=True,
        num_prefill=1 if planning else args.prefill, num_decode=1 if planning else args.decode,
        worker_args=("--engine", "simulated", "--profile", profile_path, "--sim-time-scale", str(scale),
                     "--page-size", "64", "--no-warmup", "--max-model-len", "20000", "--max-num-seqs", "256",
                     "--max-num-batched-tokens", str(args.chunk_tokens), "--no-prefix-cache"),
        router_args=("--health-interval-s", "0.5"))
    print(f"planner-day: {args.policy}, {len(requests)} requests over {HOURS} x {args.hour_s:g} s simulated "
          f"({HOURS * args.hour_s * scale:.0f} s wall), peak {args.peak_rate:g} req/s", file=sys.stderr, flush=True)
    decisions: list[dict] = []
    samples: list[dict] = []
    with InProcessCluster(cfg, transfer="inprocess") as cluster:
        stop = threading.Event()
        pools = planner_thread = None
        started = time.monotonic()
        if planning:
            planner_cfg = PlannerConfig(
                slo_ttft_s=args.slo_ttft_s * scale, slo_itl_s=args.slo_itl_s * scale,
                prefill_chunk_tokens=args.chunk_tokens, interval_s=args.interval_s * scale,
                lookahead_s=args.start_delay_s * scale + args.interval_s * scale,
                scale_down_window_s=args.scale_down_window_s * scale, max_prefill=args.max_workers,
                max_decode=args.max_workers)
            pools = ClusterPools(cluster, start_delay_s=args.start_delay_s * scale)
            planner = Planner(planner_cfg, scaled_profile(profile, scale))

            def note(decision, traffic, current) -> None:
                decisions.append({"wall_s": time.monotonic() - started, "rate": traffic.request_rate * scale,
                                  "current": dataclasses.asdict(current),
                                  "target": dataclasses.asdict(decision.target),
                                  "ttft_p99_s": traffic.ttft_p99_s / scale, "itl_p99_s": traffic.itl_p99_s / scale,
                                  "reasons": list(decision.reasons)})

            planner_thread = threading.Thread(target=run_planner, args=(
                planner, pools, router_urls_now(lambda: [cluster.url]), stop, note), daemon=True)
            planner_thread.start()
        sampler = threading.Thread(target=sample_pools, args=(cluster, pools, stop, 0.25 * scale, started, samples),
                                   daemon=True)
        sampler.start()
        done = [0]

        def progress(_) -> None:
            done[0] += 1
            if done[0] % 200 == 0:
                print(f"planner-day: {done[0]}/{len(requests)} done", file=sys.stderr, flush=True)

        limits = RunLimits(request_timeout_s=120 * scale, run_timeout_s=HOURS * args.hour_s * scale + 300)
        results, duration_s = asyncio.run(run_workload(cluster.url, requests, workload, limits, progress))
        stop.set()
        if planner_thread is not None:
            planner_thread.join(60)
        sampler.join(10)
        if pools is not None:
            pools.close()
    slo = SLO(args.slo_ttft_s, args.slo_itl_s)
    records = [{"arrival_s": r.arrival_s / scale, "ok": res.ok,
                "ttft_s": res.ttft_s / scale if res.ttft_s is not None else None,
                "itl_p99_s": (percentile(res.itl_s, 99) or 0.0) / scale, "output_tokens": res.output_tokens}
               for r, res in zip(requests, results)]
    result = {"policy": args.policy if planning else f"fixed {args.prefill}P{args.decode}D", "scale": scale,
              "hour_s": args.hour_s, "peak_rate": args.peak_rate, "trough_share": args.trough_share,
              "profile": profile.name, "slo": dataclasses.asdict(slo), "duration_s": duration_s / scale,
              "samples": [{**s, "sim_s": s["wall_s"] / scale} for s in samples], "decisions": decisions,
              "requests": records, "summary": summarize(records, samples, slo, scale, args.hour_s)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "planner" if planning else f"fixed-{args.prefill}p{args.decode}d"
    (out / f"{name}.json").write_text(json.dumps(result))
    print(json.dumps({"policy": result["policy"], **result["summary"]}))


def meets(record: dict, slo: SLO) -> bool:
    return record["ok"] and record["ttft_s"] is not None and record["ttft_s"] <= slo.ttft_s \
        and record["itl_p99_s"] <= slo.itl_p99_s


def summarize(records: list[dict], samples: list[dict], slo: SLO, scale: float, hour_s: float) -> dict:
    """SLO attainment and GPU-hours (one GPU per worker; a simulated hour is `hour_s` seconds of simulated time)."""
    gpu_seconds = sum((s["prefill"] + s["decode"]) * 0.25 for s in samples)  # each sample covers 0.25 s simulated
    ttfts = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    return {"requests": len(records), "failed": sum(not r["ok"] for r in records),
            "slo_attainment": sum(meets(r, slo) for r in records) / max(1, len(records)),
            "gpu_hours": gpu_seconds / hour_s,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "itl_p99_p50_s": percentile([r["itl_p99_s"] for r in records if r["ok"]], 50),
            "max_workers": max((s["prefill"] + s["decode"] for s in samples), default=0)}


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(Path(path).read_text()) for path in args.results]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    first = results[0]
    hour_s = first["hour_s"]
    figure, (rate_axis, pool_axis, slo_axis) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    hours = [h / 10 for h in range(HOURS * 10)]
    rate_axis.plot(hours, [day_rate(h, first["peak_rate"], first["trough_share"]) for h in hours], color="black")
    rate_axis.set_ylabel("arrival rate (req/s)")
    for result in results:
        samples = result["samples"]
        pool_axis.step([s["sim_s"] / hour_s for s in samples], [s["prefill"] + s["decode"] for s in samples],
                       where="post", label=f"{result['policy']}: all workers")
        if result["policy"] == "planner":
            pool_axis.step([s["sim_s"] / hour_s for s in samples], [s["prefill"] for s in samples], where="post",
                           linestyle=":", label="planner: prefill")
            pool_axis.step([s["sim_s"] / hour_s for s in samples], [s["decode"] for s in samples], where="post",
                           linestyle="--", label="planner: decode")
        by_hour: dict[int, list[bool]] = {}
        for record in result["requests"]:
            slo = SLO(**result["slo"])
            by_hour.setdefault(int(record["arrival_s"] / hour_s), []).append(meets(record, slo))
        slo_axis.plot([h + 0.5 for h in sorted(by_hour)], [sum(v) / len(v) for _, v in sorted(by_hour.items())],
                      marker="o", label=result["policy"])
    pool_axis.set_ylabel("GPUs (workers) held")
    pool_axis.legend(fontsize=8)
    slo_axis.set_ylabel("share of requests meeting the SLO")
    slo_axis.set_xlabel("hour of the (compressed) day")
    slo_axis.legend(fontsize=8)
    for axis in (rate_axis, pool_axis, slo_axis):
        axis.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(out / "day_trace.png", dpi=100)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(6, 4))
    for result in results:
        summary = result["summary"]
        axis.scatter(summary["gpu_hours"], summary["slo_attainment"] * 100, s=60)
        axis.annotate(result["policy"], (summary["gpu_hours"], summary["slo_attainment"] * 100), fontsize=8,
                      xytext=(5, 5), textcoords="offset points")
    axis.set_xlabel("GPU-hours per day")
    axis.set_ylabel("requests meeting the SLO (%)")
    axis.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(out / "slo_vs_gpu_hours.png", dpi=100)
    plt.close(figure)

    print("| policy | requests | failed | SLO attainment | GPU-hours per day | most workers | TTFT p50 / p99 (s) | "
          "median request ITL p99 (ms) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for result in results:
        s = result["summary"]
        print(f"| {result['policy']} | {s['requests']} | {s['failed']} | {s['slo_attainment'] * 100:.1f}% | "
              f"{s['gpu_hours']:.1f} | {s['max_workers']} | {s['ttft_p50_s']:.2f} / {s['ttft_p99_s']:.2f} | "
              f"{(s['itl_p99_p50_s'] or 0) * 1e3:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="one deployment over the day trace")
    run_parser.add_argument("--policy", choices=("planner", "fixed"), required=True)
    run_parser.add_argument("--prefill", type=int, default=1, help="fixed: prefill workers")
    run_parser.add_argument("--decode", type=int, default=1, help="fixed: decode workers")
    run_parser.add_argument("--max-workers", type=int, default=6, help="planner: most workers per pool")
    run_parser.add_argument("--model", help="model directory for vocabulary and tokenizer (default: the tiny model)")
    run_parser.add_argument("--profile", default="", help="step profile (default: V2-Lite on one H100)")
    run_parser.add_argument("--preset", default="mixed")
    run_parser.add_argument("--output-len", type=int, nargs=2, default=(64, 192), metavar=("LOW", "HIGH"))
    run_parser.add_argument("--peak-rate", type=float, default=16.0, help="simulated req/s at the daily peak")
    run_parser.add_argument("--trough-share", type=float, default=0.1, help="night rate as a share of the peak")
    run_parser.add_argument("--hour-s", type=float, default=8.0, help="simulated seconds per hour of the day")
    run_parser.add_argument("--sim-time-scale", type=float, default=2.0)
    run_parser.add_argument("--chunk-tokens", type=int, default=8192)
    run_parser.add_argument("--slo-ttft-s", type=float, default=2.0)
    run_parser.add_argument("--slo-itl-s", type=float, default=0.05)
    run_parser.add_argument("--interval-s", type=float, default=2.0, help="planner interval (simulated s)")
    run_parser.add_argument("--start-delay-s", type=float, default=1.0, help="a new worker's start (simulated s)")
    run_parser.add_argument("--scale-down-window-s", type=float, default=24.0,
                            help="simulated s (24: four compressed hours at --hour-s 6)")
    run_parser.add_argument("--seed", type=int, default=0)
    run_parser.add_argument("--out", required=True)
    run_parser.set_defaults(func=run)
    plot_parser = commands.add_parser("plot", help="plots and the table from runs")
    plot_parser.add_argument("results", nargs="+")
    plot_parser.add_argument("--out-dir", default="docs/planner")
    plot_parser.set_defaults(func=plot)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
