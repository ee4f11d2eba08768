"""Chaos under load: a local cluster (router, a prefill, a decode and a colocated `both` worker, 2 DP ranks each) runs
the soak load generator (tests/reliability/load.py) while, one phase each, a prefill worker, a decode worker, one
rank actor of the `both` worker and the router are SIGKILLed and restarted. Per fault: requests completed, migrated
and retried (router counters), failed with a clear error, cut (connection refused or broken: the router was down),
hung (must be 0), lost (a response that silently ended short; must be 0), and the time from the kill until the token
throughput is back to RECOVERED_FRACTION of the throughput before it.

    PYTHONPATH=. python benchmarks/chaos.py [--concurrency 16] [--fault-at-s 8] [--after-restart-s 12]
"""

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reliability"))
from load import LoadReport, rank_actor_pids_of, run_load  # noqa: E402 - the soak's load generator, shared

from pdserve.cli.generate import default_model_dir  # noqa: E402
from pdserve.cluster.local import ClusterConfig, LocalCluster, ProcessInfo  # noqa: E402

REQUEST_TIMEOUT_S = 120.0
RECOVERY_TIMEOUT_S = 180.0
RECOVERED_FRACTION = 0.8
THROUGHPUT_WINDOW_S = 5.0
WARMUP_S = 3.0
FAULTS = ("prefill worker", "decode worker", "one rank of a 2-rank worker", "router")


@dataclass
class ChaosConfig:
    concurrency: int = 16
    fault_at_s: float = 8.0  # load before the kill
    after_restart_s: float = 12.0  # load after the restarted part is back


@dataclass
class FaultResult:
    fault: str
    report: LoadReport
    migrated: int
    retried: int
    restart_s: float  # kill until the restarted part is healthy and routable again
    recover_s: float | None  # kill until throughput is back; None: not within the phase
    baseline_tok_s: float
    lowest_tok_s: float  # the lowest THROUGHPUT_WINDOW_S window after the kill
    notes: list[str] = field(default_factory=list)


def chaos_cluster_config(model: str, log_dir: str) -> ClusterConfig:
    return ClusterConfig(model=model, port=0, num_prefill=1, num_decode=1, num_both=1, ranks_per_worker=2,
                         worker_args=("--dtype", "float32", "--num-pages", "512"), log_dir=log_dir)


def wait_until(check: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not within {timeout_s} s")


def router_counter(router_url: str, name: str) -> float:
    for line in httpx.get(router_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def health_status(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2.0).status_code
    except httpx.HTTPError:
        return None


def router_sees_all_workers(cluster: LocalCluster) -> bool:
    seen = httpx.get(cluster.url + "/health", timeout=2.0).json().get("workers", {})
    return sum(state == "ok" for state in seen.values()) >= len(cluster.workers)


def worker_named(cluster: LocalCluster, name: str) -> ProcessInfo:
    return next(w for w in cluster.workers if w.name == name)


def restart_process(cluster: LocalCluster, info: ProcessInfo, notes: list[str]) -> None:
    cluster.restart(info, timeout_s=RECOVERY_TIMEOUT_S)  # SIGKILL of its process group, then the same command
    wait_until(lambda: router_sees_all_workers(cluster), RECOVERY_TIMEOUT_S, "router routes to every worker")


def kill_one_rank(cluster: LocalCluster, notes: list[str]) -> None:
    worker = worker_named(cluster, "both-0")
    pids = rank_actor_pids_of(worker.process.pid)
    if len(pids) != 2:
        raise RuntimeError(f"expected 2 rank actors of {worker.name}, found {pids}")
    os.kill(pids[-1], signal.SIGKILL)  # not expert-parallel: Ray restarts this one actor
    try:
        wait_until(lambda: health_status(worker.url) == 503, 15.0, "worker reports unhealthy")
        notes.append("worker reported unhealthy")
    except TimeoutError:
        notes.append("worker never reported unhealthy")
    wait_until(lambda: health_status(worker.url) == 200, RECOVERY_TIMEOUT_S, "worker healthy again")
    wait_until(lambda: router_sees_all_workers(cluster), RECOVERY_TIMEOUT_S, "router routes to every worker")
    new_pids = rank_actor_pids_of(worker.process.pid)
    if len(new_pids) != 2 or pids[-1] in new_pids:
        notes.append(f"rank actors after the restart: {new_pids} (before {pids})")


def inject(cluster: LocalCluster, fault: str, notes: list[str]) -> None:
    if fault == "prefill worker":
        restart_process(cluster, worker_named(cluster, "prefill-0"), notes)
    elif fault == "decode worker":
        restart_process(cluster, worker_named(cluster, "decode-0"), notes)
    elif fault == "one rank of a 2-rank worker":
        kill_one_rank(cluster, notes)
    elif fault == "router":
        cluster.restart(cluster.router, timeout_s=RECOVERY_TIMEOUT_S)  # same port
        wait_until(lambda: router_sees_all_workers(cluster), RECOVERY_TIMEOUT_S, "restarted router sees its workers")
    else:
        raise ValueError(f"unknown fault {fault!r}")


def recovery_s(report: LoadReport, baseline_tok_s: float, killed_s: float, end_s: float) -> float | None:
    """Seconds from the kill until token throughput is back for good: every THROUGHPUT_WINDOW_S window starting
    from then to the end holds RECOVERED_FRACTION of the baseline's tokens (None: still short at the end). Tokens
    count when their request ends, so this includes the latency of requests in flight."""
    needed = RECOVERED_FRACTION * baseline_tok_s * THROUGHPUT_WINDOW_S
    starts = frange(killed_s, end_s - THROUGHPUT_WINDOW_S, 0.25)
    short = [start for start in starts if report.tokens_between(start, start + THROUGHPUT_WINDOW_S) < needed]
    if not starts or short and short[-1] == starts[-1]:
        return None
    return short[-1] + 0.25 - killed_s if short else 0.0


async def run_phase(cluster: LocalCluster, model: str, fault: str, cfg: ChaosConfig, seed: int) -> FaultResult:
    notes: list[str] = []
    started_s = time.monotonic()
    stop = asyncio.Event()
    longest_s = cfg.fault_at_s + RECOVERY_TIMEOUT_S + cfg.after_restart_s
    load = asyncio.create_task(run_load(cluster.url, model, cfg.concurrency, longest_s, REQUEST_TIMEOUT_S, seed, stop))
    migrations_start = router_counter(cluster.url, "pdserve_router_migrations_total")
    retries_start = router_counter(cluster.url, "pdserve_router_retries_total")
    await asyncio.sleep(cfg.fault_at_s)
    # Read just before the kill: a restarted router counts from zero.
    migrations_before = router_counter(cluster.url, "pdserve_router_migrations_total") - migrations_start
    retries_before = router_counter(cluster.url, "pdserve_router_retries_total") - retries_start
    killed_s = time.monotonic()
    await asyncio.to_thread(inject, cluster, fault, notes)
    restart_s = time.monotonic() - killed_s
    await asyncio.sleep(cfg.after_restart_s)
    end_s = time.monotonic()
    stop.set()
    report = await asyncio.wait_for(load, longest_s + 2 * REQUEST_TIMEOUT_S)
    migrations_after = router_counter(cluster.url, "pdserve_router_migrations_total")
    retries_after = router_counter(cluster.url, "pdserve_router_retries_total")
    if fault == "router":
        migrated, retried = migrations_before + migrations_after, retries_before + retries_after
    else:
        migrated, retried = migrations_after - migrations_start, retries_after - retries_start
    baseline_tok_s = report.tokens_between(started_s + WARMUP_S, killed_s) / (killed_s - started_s - WARMUP_S)
    windows = [report.tokens_between(t, t + THROUGHPUT_WINDOW_S) / THROUGHPUT_WINDOW_S
               for t in frange(killed_s, end_s - THROUGHPUT_WINDOW_S, 0.25)]
    return FaultResult(fault, report, int(migrated), int(retried), restart_s,
                       recovery_s(report, baseline_tok_s, killed_s, end_s), baseline_tok_s,
                       min(windows, default=0.0), notes)


def frange(start: float, stop: float, step: float) -> list[float]:
    return [start + i * step for i in range(max(0, int((stop - start) / step) + 1))]


def run_chaos(cluster: LocalCluster, cfg: ChaosConfig, faults: tuple[str, ...] = FAULTS) -> list[FaultResult]:
    model = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return [asyncio.run(run_phase(cluster, model, fault, cfg, seed)) for seed, fault in enumerate(faults)]


def cut_in_flight(report: LoadReport) -> int:
    """Connections broken mid-request, as opposed to refused while the router was down."""
    return sum(not cut.startswith("ConnectError") for cut in report.cut)


def format_table(results: list[FaultResult]) -> str:
    header = ("| fault | completed | migrated | retried | failed (clear error) | cut in flight / refused | hung | lost "
              "| restart s | recover s | tok/s before | lowest tok/s after |")
    rows = [header, "|" + " --- |" * 12]
    for r in results:
        recover = f"{r.recover_s:.1f}" if r.recover_s is not None else "not in phase"
        rows.append(f"| {r.fault} | {r.report.completed} | {r.migrated} | {r.retried} | {len(r.report.errors)} "
                    f"| {cut_in_flight(r.report)} / {len(r.report.cut) - cut_in_flight(r.report)} | {r.report.hung} | {len(r.report.lost)} | {r.restart_s:.1f} "
                    f"| {recover} | {r.baseline_tok_s:.0f} | {r.lowest_tok_s:.0f} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the generated tiny model)")
    parser.add_argument("--concurrency", type=int, default=ChaosConfig.concurrency)
    parser.add_argument("--fault-at-s", type=float, default=ChaosConfig.fault_at_s)
    parser.add_argument("--after-restart-s", type=float, default=ChaosConfig.after_restart_s)
    args = parser.parse_args()
    cfg = ChaosConfig(args.concurrency, args.fault_at_s, args.after_restart_s)
    log_dir = tempfile.mkdtemp(prefix="pdserve-chaos-")
    with LocalCluster(chaos_cluster_config(str(args.model or default_model_dir()), log_dir)) as cluster:
        results = run_chaos(cluster, cfg)
    print(format_table(results))
    for r in results:
        for sample in (r.report.errors[:3] + r.report.cut[:2] + r.report.lost[:3] + r.notes):
            print(f"  {r.fault}: {sample}")
    print(f"logs: {log_dir}")
    ray.shutdown()
    return 0 if all(r.report.hung == 0 and not r.report.lost for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
