"""Colocated against disaggregated on the same machine, model and workload: one deployment per invocation.

`run` starts ONE deployment as a local cluster (colocated: 2 `both` workers; pd: 1 prefill + 1 decode; conditional:
the same P/D workers with the router prefilling short prompts on the decode worker when that is faster), replays the
workload at each rate in turn and writes the results after every rate, so a run cut short by a command limit (the
GPU host allows 600 s per command) keeps what it measured. Every rate replays a workload of its own seed: no prompt
of one rate can hit the prefix cache warmed by another. The cluster processes' logs are packed beside the results.
`compare` reads the results of several runs and prints the tables and plots.

    python benchmarks/pd_vs_colocated.py run --deployment pd --rates 1,2,4 --out docs/bench-cpu          # tiny model, CPU
    python benchmarks/pd_vs_colocated.py run --deployment pd --gpu --rates 8,16,20 --out $OUT --deadline-s 540
    python benchmarks/pd_vs_colocated.py compare --out docs/bench-cpu
"""

import argparse
import json
import re
import tarfile
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

from pdserve.bench.client import RunLimits
from pdserve.bench.plot import plot_goodput_vs_rate, plot_latency_cdfs
from pdserve.bench.presets import PRESETS, workload_from_preset
from pdserve.bench.report import SLO, compare_table, read_json, summary_lines, within_slo, write_json
from pdserve.bench.runner import run_benchmark
from pdserve.bench.workload import LengthRange
from pdserve.cluster.local import ClusterConfig, LocalCluster

ROLES = {"colocated": dict(num_prefill=0, num_decode=0, num_both=2),
         "pd": dict(num_prefill=1, num_decode=1, num_both=0),
         "conditional": dict(num_prefill=1, num_decode=1, num_both=0)}
V2_LITE = Path(__file__).resolve().parents[1] / "pdserve" / "model" / "configs" / "deepseek-v2-lite.json"
# Summed over every sample of the family (all ranks): what moved between the workers during one rate.
SCRAPED = ("pdserve_kv_transfer_bytes_total", "pdserve_kv_transfer_seconds_sum", "pdserve_kv_transfer_seconds_count",
           "pdserve_kv_transfer_failures_total", "pdserve_kv_transfer_descriptors_total",
           "pdserve_kv_transfer_posting_seconds_total", "pdserve_kv_transfer_queued_seconds_total",
           "pdserve_kv_transfer_post_call_seconds_total",
           "pdserve_router_local_prefills_total",
           "pdserve_host_kv_cache_offloaded_pages_total", "pdserve_host_kv_cache_loaded_pages_total",
           "pdserve_inter_token_latency_seconds_count")
# The router's own inter-token histogram, at these bounds: which gaps were already there before the client read them.
ITL_BOUNDS = ("0.05", "0.1")


def scrape_metrics(url: str) -> str:
    try:
        return httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return ""


def samples(text: str, name: str) -> list[float]:
    """The values of every sample of `name` (whatever its labels) in a /metrics text."""
    return [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]


def scrape_gauge(url: str, name: str) -> float:
    """A gauge summed over the worker's ranks (0 where the worker does not answer)."""
    return sum(samples(scrape_metrics(url), name))


def scrape_totals(url: str) -> dict[str, float]:
    text = scrape_metrics(url)
    if not text:
        return {}
    totals = {}
    for name in SCRAPED:
        if values := samples(text, name):
            totals[name] = sum(values)
    for bound in ITL_BOUNDS:
        pattern = rf'^pdserve_inter_token_latency_seconds_bucket{{[^}}]*le="{bound}"[^}}]*}} (\S+)$'
        values = re.findall(pattern, text, re.M)
        if values:
            totals[f"itl_le_{bound}"] = sum(float(v) for v in values)
    return totals


def router_itl_text(moved: dict[str, float]) -> str:
    gaps = moved.get("pdserve_inter_token_latency_seconds_count", 0.0)
    if not gaps:
        return "-"
    return ", ".join(f"{1 - moved.get(f'itl_le_{bound}', 0.0) / gaps:.1%} over {float(bound) * 1e3:g} ms"
                     for bound in ITL_BOUNDS)


def kv_rate_text(moved: dict[str, float]) -> str:
    seconds, count = moved.get("pdserve_kv_transfer_seconds_sum", 0.0), moved.get("pdserve_kv_transfer_seconds_count", 0.0)
    if not seconds or not count:
        return "-"
    num_bytes = moved.get("pdserve_kv_transfer_bytes_total", 0.0)
    # Byte ranges per write: one per layer and run of pages consecutive on both sides, so how fragmented pools were.
    ranges = moved.get("pdserve_kv_transfer_descriptors_total", 0.0) / count
    posting_ms = moved.get("pdserve_kv_transfer_posting_seconds_total", 0.0) / count * 1e3
    queued_ms = moved.get("pdserve_kv_transfer_queued_seconds_total", 0.0) / count * 1e3
    post_call_ms = moved.get("pdserve_kv_transfer_post_call_seconds_total", 0.0) / count * 1e3
    return (f"{num_bytes / seconds / 1e9:.1f} GB/s ({num_bytes / count / 1e6:.3g} MB, {seconds / count * 1e3:.1f} "
            f"ms/write, {posting_ms:.1f} ms of it before posting ({queued_ms:.1f} waiting for another post), "
            f"{post_call_ms:.1f} in NIXL's post call, {ranges:.0f} byte ranges/write)")


def cluster_config(args: argparse.Namespace, log_dir: Path) -> tuple[ClusterConfig, str]:
    if args.gpu:
        from pdserve.model.tiny import make_config_only_model

        model = str(make_config_only_model(tempfile.mkdtemp(), json.loads(V2_LITE.read_text())))
        worker_args = ["--dtype", "bfloat16", "--load-format", "random", "--gpus-per-rank", "1", "--page-size", "64",
                       "--max-num-seqs", "256", "--max-num-batched-tokens", "8192"]
        preset = args.preset or "mixed"
    else:
        from pdserve.cli.generate import default_model_dir

        model, worker_args, preset = str(default_model_dir()), ["--dtype", "float32"], args.preset or "mixed-cpu"
    if not args.prefix_cache:
        worker_args.append("--no-prefix-cache")
    router_args = ()
    if args.deployment == "conditional":
        router_args = ("--local-prefill-max-tokens", str(args.local_prefill_max_tokens),
                       "--local-prefill-min-wait-ms", str(args.local_prefill_min_wait_ms),
                       "--local-prefill-max-stall-ms", str(args.local_prefill_max_stall_ms),
                       "--local-prefill-long-step-share", str(args.local_prefill_long_step_share))
    cfg = ClusterConfig(model, port=0, worker_args=tuple(worker_args + args.worker_args.split()), router_args=router_args,
                        start_timeout_s=480.0, log_dir=str(log_dir), **ROLES[args.deployment])
    return cfg, preset


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix=f"pdserve-{args.deployment}-logs-"))
    cfg, preset = cluster_config(args, log_dir)
    slo = SLO(args.slo_ttft_s, args.slo_itl_p99_s)
    rates = [float(r) for r in args.rates.split(",")]
    record: dict = {"deployment": args.deployment, "preset": preset, "worker_args": list(cfg.worker_args),
                    "router_args": list(cfg.router_args), "slo": {"ttft_s": slo.ttft_s, "itl_p99_s": slo.itl_p99_s},
                    "points": [], "skipped": []}
    rows = []
    try:
        with LocalCluster(cfg) as cluster:
            record["startup_s"] = time.monotonic() - started
            record["kv_pool_pages"] = {w.name: scrape_gauge(w.url, "pdserve_kv_cache_pages") for w in cluster.workers}
            pools = ", ".join(f"{name} {pages:,.0f}" for name, pages in record["kv_pool_pages"].items())
            print(f"[{time.monotonic() - started:5.0f} s] {args.deployment} up: {cluster.url} (KV pool pages: {pools})",
                  flush=True)
            base = workload_from_preset(preset, num_requests=args.min_requests, seed=args.seed, request_rate=rates[0])
            warm = replace(base, seed=args.seed + 10_000, num_requests=8, request_rate=None, max_concurrency=2,
                           long_fraction=0.5, output_len=LengthRange(4, 8))
            run_benchmark(cluster.url, warm, slo, RunLimits(request_timeout_s=300.0, run_timeout_s=400.0), progress=False)
            for index, rate in enumerate(rates):
                num_requests = max(args.min_requests, round(rate * args.window_s))
                arrivals_s = num_requests / rate
                left_s = args.deadline_s - (time.monotonic() - started)
                if arrivals_s + args.drain_s > left_s:
                    print(f"skip {rate:g} req/s: {arrivals_s + args.drain_s:.0f} s needed, {left_s:.0f} s left", flush=True)
                    record["skipped"].append(rate)
                    continue
                workload = replace(base, seed=args.seed + 1 + index, num_requests=num_requests, request_rate=rate)
                before = {w.name: scrape_totals(w.url) for w in cluster.workers} | {"router": scrape_totals(cluster.url)}
                result = run_benchmark(cluster.url, workload, slo,
                                       RunLimits(request_timeout_s=180.0, run_timeout_s=arrivals_s + args.drain_s),
                                       progress=False, label=f"{args.deployment} {rate:g}/s")
                after = {w.name: scrape_totals(w.url) for w in cluster.workers} | {"router": scrape_totals(cluster.url)}
                moved = {name: {k: v - before[name].get(k, 0.0) for k, v in totals.items()} for name, totals in after.items()}
                kv = {k: sum(m.get(k, 0.0) for m in moved.values()) for k in SCRAPED}
                summary = result["summary"]
                point = {"request_rate": rate, "meets_slo": within_slo(summary, slo), "summary": summary, "moved": moved,
                         "errors": sorted({r["error"][:200] for r in result["requests"] if not r["ok"]})[:5]}
                record["points"].append({**point, "result": result})
                rows.append(row(args.deployment, rate, summary, point["meets_slo"], kv))
                print(f"[{time.monotonic() - started:5.0f} s] {args.deployment} {rate:g} req/s:\n{summary_lines(summary)}"
                      f"\n  KV transfer: {kv_rate_text(kv)}; local prefills: {kv['pdserve_router_local_prefills_total']:.0f}"
                      + f"\n  router-seen ITL: {router_itl_text(moved['router'])}"
                      + f"\n  host KV tier pages: {kv['pdserve_host_kv_cache_offloaded_pages_total']:.0f} offloaded, "
                        f"{kv['pdserve_host_kv_cache_loaded_pages_total']:.0f} loaded back"
                      + (f"\n  errors: {point['errors']}" if point["errors"] else ""), flush=True)
                write_json(out / f"{args.deployment}.json", record)
    finally:
        write_json(out / f"{args.deployment}.json", record)
        with tarfile.open(out / f"{args.deployment}_logs.tar.gz", "w:gz") as packed:
            packed.add(log_dir, arcname=f"{args.deployment}_logs")
        print("\n" + TABLE_HEAD + "\n" + "\n".join(rows), flush=True)
    return 0


TABLE_HEAD = ("| deployment | rate (req/s) | completed | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) "
              "| output tok/s | goodput (req/s) | meets SLO | KV transfer |\n"
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")


def row(name: str, rate: float, s: dict, meets: bool, kv: dict[str, float]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.0f}" if value >= 0.1 else f"{value * 1e3:.1f}"

    return (f"| {name} | {rate:g} | {s['completed']}/{s['num_requests']} | {ms(s['ttft_s']['p50'])} | "
            f"{ms(s['ttft_s']['p99'])} | {ms(s['itl_s']['p50'])} | {ms(s['itl_s']['p99'])} | "
            f"{s['output_tokens_per_s']:,.0f} | {s['goodput_requests_per_s']:.2f} | {'yes' if meets else 'no'} | "
            f"{kv_rate_text(kv)} |")


def compare(args: argparse.Namespace) -> int:
    out = Path(args.out)
    records = {name: read_json(out / f"{name}.json") for name in ROLES if (out / f"{name}.json").exists()}
    if not records:
        raise SystemExit(f"no results in {out}: run `run --deployment ...` first")
    print(TABLE_HEAD)
    for name, record in records.items():
        for point in record["points"]:
            kv = {k: sum(m.get(k, 0.0) for m in point["moved"].values()) for k in SCRAPED}
            print(row(name, point["request_rate"], point["summary"], point["meets_slo"], kv))
    for name, record in records.items():
        best = max((p["request_rate"] for p in record["points"] if p["meets_slo"]), default=None)
        print(f"{name}: highest rate meeting the SLO: {best}")
    plot_goodput_vs_rate({name: r["points"] for name, r in records.items()}, out / "goodput_vs_rate.png")
    common = set.intersection(*({p["request_rate"] for p in r["points"]} for r in records.values()))
    if common and len(records) > 1:
        rate = min(common)
        at_rate = {name: next(p["result"] | {"label": name} for p in r["points"] if p["request_rate"] == rate)
                   for name, r in records.items()}
        plot_latency_cdfs(list(at_rate.values()), out / f"latency_cdf_{rate:g}rps.png")
        names = list(at_rate)
        for left, right in zip(names, names[1:]):
            print(f"\nat {rate:g} req/s:\n" + compare_table(at_rate[left], at_rate[right], left, right))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="one deployment, every rate, results after each")
    run_parser.add_argument("--deployment", choices=tuple(ROLES), required=True)
    run_parser.add_argument("--gpu", action="store_true", help="DeepSeek-V2-Lite shape, random bf16 weights, 1 GPU/worker")
    run_parser.add_argument("--preset", choices=tuple(PRESETS), help="default: mixed (GPU) or mixed-cpu")
    run_parser.add_argument("--rates", default="1,2,4", help="Poisson rates (req/s), run in this order")
    run_parser.add_argument("--window-s", type=float, default=25.0, help="requests per rate: max(min, rate x window)")
    run_parser.add_argument("--min-requests", type=int, default=40)
    run_parser.add_argument("--deadline-s", type=float, default=3600.0, help="skip a rate that would end after this")
    run_parser.add_argument("--drain-s", type=float, default=45.0, help="allowed past the last arrival")
    run_parser.add_argument("--seed", type=int, default=0)
    run_parser.add_argument("--slo-ttft-s", type=float, default=2.0)
    run_parser.add_argument("--slo-itl-p99-s", type=float, default=0.05)
    run_parser.add_argument("--prefix-cache", action="store_true", help="keep the prefix cache on (default off)")
    run_parser.add_argument("--local-prefill-max-tokens", type=int, default=4096, help="conditional: longest prompt")
    run_parser.add_argument("--local-prefill-min-wait-ms", type=float, default=0.0,
                            help="conditional: the prefill rank's queue time that makes it busy (0: no test)")
    run_parser.add_argument("--local-prefill-max-stall-ms", type=float, default=0.0,
                            help="conditional: the longest step (decode + a chunk) a decode worker's prompt may "
                                 "make (0: no test)")
    run_parser.add_argument("--local-prefill-long-step-share", type=float, default=0.0,
                            help="conditional: the share of the decode worker's steps prompts may make longer")
    run_parser.add_argument("--worker-args", default="", help="extra `pdserve worker` flags, space-separated")
    run_parser.add_argument("--out", default="bench-out")
    compare_parser = sub.add_parser("compare", help="tables and plots from the runs in --out")
    compare_parser.add_argument("--out", default="bench-out")
    args = parser.parse_args()
    return run(args) if args.command == "run" else compare(args)


if __name__ == "__main__":
    raise SystemExit(main())
