"""The router in front of many ranks: simulated prefill and decode workers (pdserve/engine/simulated.py: real
scheduler, pages, prefix cache and KV events; steps sleep what the DeepSeek-V2-Lite H100 profile predicts) in one
in-process cluster, a shared-prefix workload through the real router. Reports how long the router takes to choose
ranks, how much of the best possible prefix reuse its choices get, what the whole path adds, how many KV events its
prefix index ingests, and how many bytes that index holds per cached page.

    python benchmarks/router_at_scale.py [--prefill-workers 32] [--decode-workers 32] [--ranks 4] [--requests 512]

KV moves between pools by in-process copies (a NIXL agent per rank would keep a thread polling for each of the
hundreds of ranks). All workers and their ranks' step threads share this process (and the machine's cores) with the
load generator; `--sim-time-scale` stretches every simulated step when many ranks would otherwise queue on the GIL.
The router the load goes through runs in a process of its own (`--router process`, as deployed: `pdserve router`
with the cluster's workers and credential), or is the in-process cluster's own (`--router inprocess`), which then
shares the GIL with the 256 step threads. The decision timed "alone" is always the in-process router's, which
ingests the same KV events.
"""

import argparse
import contextlib
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator

import httpx
import msgspec

from pdserve.bench.client import RunLimits
from pdserve.bench.report import SLO
from pdserve.bench.runner import run_benchmark
from pdserve.bench.workload import LengthRange, WorkloadConfig, best_prefix_hit_ratio, generate_workload
from pdserve.cli.generate import default_model_dir
from pdserve.cluster.inprocess import InProcessCluster
from pdserve.cluster.layout import ClusterConfig, router_flags, wait_routable
from pdserve.http.internal_auth import TOKEN_ENV
from pdserve.http.ports import free_port
from pdserve.planner.traffic import histogram_buckets, histogram_quantile, metric_sums
from pdserve.wire.kv_events import KVEvent
from pdserve.wire.protocol import KVEventBatch
from pdserve_router.prefix_index import PrefixIndex, RankKey

DECISION = "pdserve_router_routing_decision_seconds"
KV_EVENTS = "pdserve_router_kv_events_total"


async def choices_alone(cluster: InProcessCluster, workload: WorkloadConfig, cold: bool) -> list[float]:
    """The router's choice for every prompt of the workload again, timed on its loop once the load has ended: the
    decision alone, with the index and loads the run left, no other thread busy (ms each). `cold`: the CPU caches
    are flushed before each choice (by walking ~40 MB of objects), as in service, where other requests' work runs
    between two choices."""
    dispatcher = cluster.router.server.config.app.state.parts.serving.dispatcher
    flush = [[i] for i in range(400_000)] if cold else []
    times_ms = []
    for request in generate_workload(workload):
        prompt = list(request.prompt_token_ids)
        for item in flush:
            item[0] += 1
        started = time.perf_counter()
        dispatcher.choose(prompt, set())
        times_ms.append((time.perf_counter() - started) * 1e3)
    return sorted(times_ms)


async def full_dumps(cluster: InProcessCluster) -> list[tuple[RankKey, bytes]]:
    """Every prefill rank's full KV-event dump, asked for as a restarted router does (after=-1), encoded back to the
    JSON line the worker sent, so that decoding it counts with the index it builds."""
    pool = cluster.router.server.config.app.state.parts.pool
    dumps = []
    for url, rank in pool.ranks_with_role(("prefill",)):
        batches = pool.client(url).kv_events(rank, -1)
        async with contextlib.aclosing(batches):
            dumps.append(((url, rank), msgspec.json.encode(await anext(batches))))
    return dumps


def build_index(dumps: list[tuple[RankKey, bytes]], page_size: int) -> PrefixIndex:
    """A router's index after a restart: every rank added, its dump decoded (as the worker client does) and applied."""
    decoder = msgspec.json.Decoder(KVEventBatch)
    index = PrefixIndex()
    for key, line in dumps:
        index.add_rank(key, page_size)
        index.apply(key, decoder.decode(line))
    return index


def held_bytes(dumps: list[tuple[RankKey, bytes]], page_size: int) -> tuple[PrefixIndex, int]:
    """The index built from `dumps` and the bytes it holds: what tracemalloc saw allocated while building it and not
    freed (the decoded events are freed; the page hashes the index keeps and its sets' tables are not). Run with no
    other thread allocating."""
    gc.collect()
    tracemalloc.start()
    index = build_index(dumps, page_size)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return index, held


def measure_index(dumps: list[tuple[RankKey, bytes]], page_size: int) -> dict:
    """Bytes per indexed page (over the same ranks with empty caches) and how fast dumps are decoded and applied."""
    empty_dumps = [(key, msgspec.json.encode(KVEventBatch(key[1], 0, [KVEvent("cleared")]))) for key, _ in dumps]
    _, empty_bytes = held_bytes(empty_dumps, page_size)
    index, full_bytes = held_bytes(dumps, page_size)
    pages_per_rank = sorted(len(rank.stored) for rank in index.ranks.values())
    pages = sum(pages_per_rank)
    events_per_build = sum(len(msgspec.json.decode(line, type=KVEventBatch).events) for _, line in dumps)
    builds, started = 0, time.perf_counter()
    while builds == 0 or time.perf_counter() - started < 1.0:  # one build of a small index is too short to time
        build_index(dumps, page_size)
        builds += 1
    build_s = (time.perf_counter() - started) / builds
    return {"pages": pages, "pages_per_rank": pages_per_rank, "bytes": full_bytes,
            "bytes_per_page": (full_bytes - empty_bytes) / max(pages, 1), "bytes_per_empty_rank": empty_bytes / len(dumps),
            "rebuild_events_per_s": events_per_build / build_s}


@contextlib.contextmanager
def router_process(cluster: InProcessCluster, timeout_s: float, cpu: int | None) -> Iterator[str]:
    """A `pdserve router` process in front of the cluster's workers (their credential in its environment, its log in
    a temporary file); yields its URL once it routes to every worker, and stops it after. `cpu`: the router runs on
    that CPU alone and this process on the others, as a router pod with a core of its own would."""
    port = free_port()
    flags = router_flags(cluster.cfg, [worker.url for worker in cluster.workers], port)
    log_path = os.path.join(tempfile.mkdtemp(prefix="pdserve-router-"), "router.log")
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "pdserve", "router", *flags], stdout=log,
                                   stderr=subprocess.STDOUT, env={**os.environ, TOKEN_ENV: cluster.internal_token})
    if cpu is not None:
        os.sched_setaffinity(process.pid, {cpu})
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {cpu})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_routable(url, len(cluster.workers), time.monotonic() + timeout_s)
        print(f"router process up ({url}, log {log_path})", flush=True)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


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
    parser.add_argument("--router", choices=("process", "inprocess"), default="process",
                        help="the router the load goes through: its own process, or the in-process cluster's")
    parser.add_argument("--router-cpu", type=int, default=None,
                        help="with --router process: pin the router to this CPU and keep everything else off it")
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
    with InProcessCluster(cfg, transfer="inprocess") as cluster, contextlib.ExitStack() as stack:
        start_s = time.monotonic() - started
        url = cluster.url
        if args.router == "process":
            url = stack.enter_context(router_process(cluster, 300, args.router_cpu))
        print(f"cluster up in {start_s:.1f} s; {args.requests} requests at {args.request_rate} req/s ...", flush=True)
        kv_events_before = metric_sums(httpx.get(url + "/metrics", timeout=30).text, (KV_EVENTS,))[KV_EVENTS]
        result = run_benchmark(url, workload, SLO(ttft_s=2.0, itl_p99_s=0.05),
                               RunLimits(request_timeout_s=120.0, run_timeout_s=540.0), label="router-at-scale")
        metrics_text = httpx.get(url + "/metrics", timeout=30).text
        buckets = histogram_buckets(metrics_text, DECISION)
        kv_events = metric_sums(metrics_text, (KV_EVENTS,))[KV_EVENTS] - kv_events_before
        alone_ms = cluster.run(choices_alone(cluster, workload, cold=False), 120)
        cold_ms = cluster.run(choices_alone(cluster, workload, cold=True), 600)
        dumps = cluster.run(full_dumps(cluster), 300)
    index = measure_index(dumps, args.page_size)  # the cluster's threads have stopped: tracemalloc sees only this
    summary = result["summary"]
    ratio = summary["prefix_cache_hit_ratio"] or 0.0
    print(f"\n{ranks} simulated ranks ({args.prefill_workers * args.ranks} prefill), {args.groups} groups x "
          f"{args.system_prompt_len}-token system prompts, {args.requests} requests at {args.request_rate} req/s, "
          f"time scale {args.sim_time_scale}, router: {args.router}"
          + (f" on CPU {args.router_cpu} alone" if args.router_cpu is not None else ""))
    print("| ranks | cluster start (s) | decisions | decision p50 / p99 in service (ms) | in service within 1 ms | "
          "decision p50 / p99 alone (ms) | alone, caches flushed (ms) | prefix hit ratio | best possible | of best | "
          "TTFT p50 / p99 (ms) | failed |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    ttft = summary["ttft_s"]
    alone_p50, alone_p99 = alone_ms[len(alone_ms) // 2], alone_ms[int(0.99 * (len(alone_ms) - 1))]
    cold_p50, cold_p99 = cold_ms[len(cold_ms) // 2], cold_ms[int(0.99 * (len(cold_ms) - 1))]
    # Exact, where the quantiles interpolate inside a bucket: p99 <= 1 ms holds iff this is >= 99%.
    within_1ms = next(count for bound, count in buckets if bound == 0.001) / buckets[-1][1]
    print(f"| {ranks} | {start_s:.1f} | {buckets[-1][1]:.0f} | {histogram_quantile(buckets, 0.5) * 1e3:.3f} / "
          f"{histogram_quantile(buckets, 0.99) * 1e3:.3f} | {within_1ms:.1%} | {alone_p50:.3f} / {alone_p99:.3f} | "
          f"{cold_p50:.3f} / {cold_p99:.3f} | {ratio:.3f} | "
          f"{best:.3f} | {ratio / best:.0%} | {ttft['p50'] * 1e3:.0f} / {ttft['p99'] * 1e3:.0f} | {summary['failed']} |")
    per_rank = index["pages_per_rank"]
    print("\n| KV events ingested in service | events/s in service | dump events/s decoded + applied (rebuild) | "
          "pages indexed | pages per prefill rank min / median / max | index MiB | bytes per page | bytes per empty rank |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {kv_events:.0f} | {kv_events / summary['duration_s']:.1f} | {index['rebuild_events_per_s']:,.0f} | "
          f"{index['pages']} | {per_rank[0]} / {statistics.median(per_rank):.0f} / {per_rank[-1]} | "
          f"{index['bytes'] / 2**20:.2f} | {index['bytes_per_page']:.0f} | {index['bytes_per_empty_rank']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
