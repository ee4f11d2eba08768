"""A real WorkerPool over file discovery whose workers are admitted with what their health checks would have found:
no worker is contacted (routing tests need the pool's snapshots, not the network)."""

from pathlib import Path

from pdserve.discovery.endpoints import FileDiscovery, write_endpoints_file
from pdserve.wire.client import WorkerSession
from pdserve.wire.protocol import LoadReport, RankInfo, RankLoad, WorkerHealth, WorkerInfo
from pdserve_router.metrics import RouterMetrics
from pdserve_router.prefix_index import PrefixIndex
from pdserve_router.workers import WorkerPool


def pool_of(path: Path, urls: list[str]) -> WorkerPool:
    write_endpoints_file(str(path), urls)
    pool = WorkerPool(FileDiscovery(str(path)), WorkerSession(), PrefixIndex(), RouterMetrics("tiny", "prefix"),
                      health_interval_s=1.0, health_timeout_s=1.0, eject_after_failures=3,
                      eject_unresponsive_after_s=10.0)
    pool._sync_endpoints()
    return pool


def idle_load(rank: int) -> RankLoad:
    return RankLoad(rank, running=0, waiting=0, free_pages=64, total_pages=64, prefix_cache_pages=0)


def admit(pool: WorkerPool, url: str, role: str, ranks: int, loads: list[RankLoad] | None = None,
          info: WorkerInfo | None = None) -> None:
    """A passed health check: the worker's info (kept from the last check unless given) and its ranks' loads."""
    worker = pool.workers[url]
    ranks_info = [RankInfo(r, 16, 64, f"{url}-{r}") for r in range(ranks)]
    info = info or worker.info or WorkerInfo(1, role, "tiny", 4096, ranks_info)
    pool._passed_check(worker, WorkerHealth("ok", role, ranks), info,
                       LoadReport(loads or [idle_load(r) for r in range(ranks)]))
