"""Soak: concurrent mixed streams through a real cluster (router, prefill, decode and colocated workers, in this
process) for a fixed time: 0 errors, 0 hung requests, every page pool back to baseline, the process's resident memory
reported with its growth after warm-up (bounded loosely; CPU timings on a shared machine are noisy).

The CI version runs 20 s with 16 concurrent streams (2 cores: 64 would mostly queue; 60 s, then 30 s, put CI near its
15-minute budget); the `slow` one runs 10 minutes with 64."""

import asyncio
import os
import time

import pytest
from load import LoadReport, rss_bytes, run_load
from probes import eventually
from stream_calls import model_of, pages_at_rest

REQUEST_TIMEOUT_S = 120.0
MIB = 1024 * 1024


def memory_mib(pids: dict[str, int]) -> dict[str, float]:
    sizes = {}
    for name, pid in pids.items():
        try:
            sizes[name] = rss_bytes(pid) / MIB
        except OSError:
            continue  # a rank actor of a cluster that has gone since
    return sizes


def soak(cluster, concurrency: int, duration_s: float, warmup_s: float) -> None:
    model = model_of(cluster.url)
    pids = {"cluster (this process)": os.getpid()}
    before = memory_mib(pids)

    async def load_with_warmup() -> tuple[LoadReport, dict[str, float]]:
        load = asyncio.create_task(run_load(cluster.url, model, concurrency, duration_s, REQUEST_TIMEOUT_S))
        await asyncio.sleep(warmup_s)
        warm = memory_mib(pids)
        return await load, warm

    started = time.monotonic()
    report, warm = asyncio.run(asyncio.wait_for(load_with_warmup(), duration_s + 2 * REQUEST_TIMEOUT_S))
    elapsed_s = time.monotonic() - started
    after = memory_mib(pids)

    print(f"\nsoak: {concurrency} concurrent, {elapsed_s:.0f} s: {report.completed} requests, {report.tokens} tokens "
          f"({report.tokens / elapsed_s:.0f} tok/s), latency p50 {report.percentile_s(0.5):.2f} s "
          f"p99 {report.percentile_s(0.99):.2f} s, errors {len(report.errors)}, hung {report.hung}")
    for name in sorted(after):
        growth = after[name] - warm.get(name, after[name])
        print(f"  rss {name:>22}: start {before.get(name, 0):7.1f} MiB  warm {warm.get(name, 0):7.1f} MiB  "
              f"end {after[name]:7.1f} MiB  growth after warm-up {growth:+6.1f} MiB")

    assert report.errors == [] and report.cut == [] and report.lost == [] and report.hung == 0, \
        (report.errors + report.cut + report.lost)[:5]
    assert report.completed >= concurrency
    for worker in cluster.workers:
        assert eventually(lambda w=worker: pages_at_rest(w.url), timeout_s=30), f"{worker.name} holds pages"
    for name, end_mib in after.items():  # loose: catches a leak of a request's worth of state per request
        assert end_mib - warm.get(name, end_mib) < max(256.0, 0.5 * warm.get(name, end_mib)), name


def test_soak_10s_16_streams_has_no_errors_no_hangs_and_no_page_leaks(pd_cluster):
    soak(pd_cluster, concurrency=16, duration_s=10, warmup_s=5)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_soak_10min_64_streams_has_no_errors_no_hangs_and_no_page_leaks(pd_cluster):
    soak(pd_cluster, concurrency=64, duration_s=600, warmup_s=60)
