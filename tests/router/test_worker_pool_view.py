"""The pool's routing snapshot: ranks in URL order, kept when workers come and go, following a worker's new info.
Real WorkerPool and file discovery; no worker is contacted (the test fills in what health checks would)."""

from pathlib import Path

from pdserve.discovery.endpoints import FileDiscovery, write_endpoints_file
from pdserve.wire.protocol import RankInfo, WorkerHealth, WorkerInfo
from pdserve_router.metrics import RouterMetrics
from pdserve_router.prefix_index import PrefixIndex
from pdserve_router.workers import WorkerPool


def pool_of(path: Path) -> WorkerPool:
    pool = WorkerPool(FileDiscovery(str(path)), None, PrefixIndex(), RouterMetrics("tiny", "prefix"),
                      health_interval_s=1.0, health_timeout_s=1.0, eject_after_failures=3,
                      eject_unresponsive_after_s=10.0)
    pool._sync_endpoints()
    return pool


def admit(pool: WorkerPool, url: str, role: str, ranks: int) -> None:
    worker = pool.workers[url]
    worker.info = WorkerInfo(1, role, "tiny", 4096, [RankInfo(r, 16, 64, f"{url}-{r}") for r in range(ranks)])
    worker.health = WorkerHealth("ok", role, ranks)
    worker.admitted = True


def test_ranks_come_in_url_order_and_follow_workers_that_come_go_and_change(tmp_path):
    workers_file = tmp_path / "workers"
    write_endpoints_file(str(workers_file), ["http://c", "http://a"])
    pool = pool_of(workers_file)
    admit(pool, "http://c", "prefill", 2)
    admit(pool, "http://a", "prefill", 1)
    assert pool.ranks_with_role(("prefill",)) == [("http://a", 0), ("http://c", 0), ("http://c", 1)]
    pool.workers["http://c"].suspect = True
    assert pool.ranks_with_role(("prefill",)) == [("http://a", 0)]
    pool.workers["http://c"].suspect = False

    write_endpoints_file(str(workers_file), ["http://c", "http://b"])  # a left, b joined
    pool._sync_endpoints()
    admit(pool, "http://b", "decode", 1)
    assert pool.ranks_with_role(("prefill",)) == [("http://c", 0), ("http://c", 1)]
    assert pool.ranks_with_role(("decode",)) == [("http://b", 0)]

    admit(pool, "http://c", "prefill", 3)  # restarted with more ranks: a new info
    assert pool.ranks_with_role(("prefill", "decode")) == [("http://b", 0)] + [("http://c", r) for r in range(3)]
