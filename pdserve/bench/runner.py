"""One benchmark run against a router URL: scrape the workers' counters, replay the workload with a progress bar,
scrape again, and assemble the result (config, summary, per-request records)."""

import asyncio
import gc
import sys
from dataclasses import asdict
from urllib.parse import urlparse

from tqdm import tqdm

from pdserve.bench.client import RequestResult, RunLimits, run_workload
from pdserve.bench.cpu_wait import read_cpu_pressure_s, read_throttling, throttling_between
from pdserve.bench.loop_watch import LoopStall, LoopWatch
from pdserve.bench.report import SLO, summarize
from pdserve.bench.worker_metrics import hit_ratio_between, scrape_prefix_counters, worker_urls
from pdserve.bench.workload import WorkloadConfig, generate_workload

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def require_local(url: str) -> None:
    """The benchmark sends load; keep it on this machine unless the caller opts out at the CLI edge."""
    host = urlparse(url).hostname
    if host not in LOCAL_HOSTS:
        raise ValueError(f"benchmark target must be on this machine (127.0.0.1), got host {host!r}")


def run_benchmark(url: str, workload: WorkloadConfig, slo: SLO, limits: RunLimits = RunLimits(),
                  progress: bool = True, label: str = "") -> dict:
    url = url.rstrip("/")
    requests = generate_workload(workload)
    workers = worker_urls(url)
    before = scrape_prefix_counters(workers)
    bar = tqdm(total=len(requests), desc=label or "bench", unit="req", disable=not progress, file=sys.stderr,
               mininterval=2.0)
    failures = 0

    def on_done(result: RequestResult) -> None:
        nonlocal failures
        failures += not result.ok
        bar.update(1)
        bar.set_postfix(failed=failures, refresh=False)

    async def watched() -> tuple[list[RequestResult], float, list[LoopStall]]:
        async with LoopWatch() as watch:
            results, duration_s = await run_workload(url, requests, workload, limits, on_done)
        return results, duration_s, watch.stalls

    # A full collection walks every object alive with the GIL held, and a process that imported torch, ray and
    # matplotlib holds ~250k (70-100 ms a collection on the 2-core machine), a stall of every stream's reads: what is
    # alive now stays out of collections while the replay runs, and goes back in after it (a caller's objects that
    # die later must still be collectable).
    gc.freeze()
    throttled_before, pressure_before_s = read_throttling(), read_cpu_pressure_s()
    try:
        results, duration_s, stalls = asyncio.run(watched())
    finally:
        gc.unfreeze()
        bar.close()
    throttling = throttling_between(throttled_before, read_throttling())
    pressure_after_s = read_cpu_pressure_s()
    pressure_s = (pressure_after_s - pressure_before_s
                  if pressure_before_s is not None and pressure_after_s is not None else None)
    hit_ratio, per_rank = hit_ratio_between(before, scrape_prefix_counters(workers))
    return {
        "label": label,
        "url": url,
        "workload": asdict(workload),
        "summary": summarize(results, duration_s, slo, hit_ratio, stalls, throttling, pressure_s),
        "prefix_cache_per_rank": per_rank,
        "requests": [
            {**asdict(result), "group": request.group, "turn": request.turn, "max_tokens": request.max_tokens}
            for request, result in zip(requests, results)
        ],
    }
