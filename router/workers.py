"""The router's view of its workers: info, polled load, health (eject a dead worker within seconds, re-admit it when
it answers again) and one KV-event subscription per prefill rank feeding the prefix index.

Everything here is rebuilt from the workers after a router restart: info and load by polling, the index from a full
KV-event dump (subscribe with after=-1)."""

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field


from pdserve.discovery.endpoints import Discovery
from pdserve.wire.client import WorkerClient, WorkerSession, WorkerUnavailable
from pdserve.wire.protocol import LoadReport, RankLoad, WorkerHealth, WorkerInfo
from pdserve_router.metrics import RouterMetrics
from pdserve_router.policies import CandidateLoads
from pdserve_router.prefix_index import PrefixIndex, RankKey
from pdserve_router.rank_table import Candidates, RankTable

logger = logging.getLogger(__name__)

KV_RESUBSCRIBE_DELAY_S = 0.5


@dataclass
class WorkerState:
    url: str
    client: WorkerClient
    info: WorkerInfo | None = None
    health: WorkerHealth | None = None
    admitted: bool = False  # passed a health check since its last ejection
    suspect: bool = False  # a request just failed to reach it: no new work until its next good health check
    consecutive_failures: int = 0
    failing_since_s: float = 0.0  # monotonic time of the first failure of the current streak
    rank_loads: dict[int, RankLoad] = field(default_factory=dict)
    kv_tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def routable(self) -> bool:
        healthy = self.health is not None and self.health.status == "ok"
        return self.admitted and not self.suspect and self.info is not None and healthy


class WorkerPool:
    def __init__(
        self,
        discovery: Discovery,
        http: WorkerSession,
        index: PrefixIndex,
        metrics: RouterMetrics,
        health_interval_s: float,
        health_timeout_s: float,
        eject_after_failures: int,
        eject_unresponsive_after_s: float,
    ) -> None:
        self._discovery = discovery
        self._http = http
        self._index = index
        self._metrics = metrics
        self._health_interval_s = health_interval_s
        self._health_timeout_s = health_timeout_s
        self._eject_after_failures = eject_after_failures
        self._eject_unresponsive_after_s = eject_unresponsive_after_s
        self.workers: dict[str, WorkerState] = {}
        self._in_url_order: list[WorkerState] = []  # self.workers' values by URL: the candidates' stable order
        self._table = RankTable()  # rows: the ranks of every worker with info; rebuilt when that set changes
        self._views: dict[tuple[str, ...], Candidates] = {}  # routable ranks by roles; cleared when routability changes
        self._supervisor: asyncio.Task | None = None

    def start(self) -> None:
        self._supervisor = asyncio.create_task(self._supervise(), name="worker-pool")

    async def close(self) -> None:
        tasks = [t for w in self.workers.values() for t in w.kv_tasks]
        if self._supervisor is not None:
            tasks.append(self._supervisor)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- snapshots for routing -------------------------------------------------------------------------------------

    def candidates(self, roles: tuple[str, ...], excluded: set[RankKey] | None = None) -> Candidates:
        """The routable ranks of workers with one of `roles`, in URL order, less `excluded`."""
        view = self._views.get(roles)
        if view is None:
            keys = [(worker.url, rank.rank) for worker in self._in_url_order
                    if worker.routable and worker.info.role in roles for rank in worker.info.ranks]
            view = self._views[roles] = self._table.candidates(keys)
        return view.without(excluded) if excluded else view

    def ranks_with_role(self, roles: tuple[str, ...]) -> list[RankKey]:
        return self.candidates(roles).keys

    def role_of(self, url: str) -> str | None:
        worker = self.workers.get(url)
        return worker.info.role if worker and worker.info else None

    def loads_of(self, candidates: Candidates) -> CandidateLoads:
        """Polled loads with the router's assignments since the poll counted as queued (by `note_assignment`)."""
        return self._table.loads_of(candidates)

    def max_model_len(self) -> int | None:
        lengths = [w.info.max_model_len for w in self.workers.values() if w.routable]
        return min(lengths) if lengths else None

    def client(self, url: str) -> WorkerClient:
        return self.workers[url].client

    def note_assignment(self, key: RankKey, prompt_tokens: int) -> None:
        """`prompt_tokens`: what the rank will prefill of it (0 for the decode rank of a P/D pair)."""
        self._table.add_waiting(key, prompt_tokens)

    def prefill_backlog(self, key: RankKey) -> tuple[int, float]:
        return self._table.prefill_backlog(key)

    def decode_backlog(self, key: RankKey) -> tuple[int, float, int]:
        return self._table.decode_backlog(key)

    def report_failure(self, url: str) -> None:
        """A request could not reach the worker: route around it until its next health check decides. Only health
        checks eject, so a burst of concurrent failures (one slow moment under load) does not eject a live worker."""
        worker = self.workers.get(url)
        if worker is not None and not worker.suspect:
            logger.warning("worker %s suspect: a request failed to reach it", url)
            worker.suspect = True
            self._views.clear()

    # --- supervision -----------------------------------------------------------------------------------------------

    async def _supervise(self) -> None:
        while True:
            self._sync_endpoints()
            await asyncio.gather(*(self._check(w) for w in list(self.workers.values())), return_exceptions=True)
            self._index.expire_pending()
            self._metrics.set_healthy_workers(sum(w.routable for w in self.workers.values()))
            await asyncio.sleep(self._health_interval_s)

    def _sync_endpoints(self) -> None:
        urls = {endpoint.url for endpoint in self._discovery.endpoints()}
        added, removed = urls - self.workers.keys(), self.workers.keys() - urls
        for url in added:
            self.workers[url] = WorkerState(url, WorkerClient(url, self._http, self._health_timeout_s))
            self._metrics.note_worker(url)
        for url in removed:
            worker = self.workers.pop(url)
            worker.client.retire_channel()
            self._stop_kv_subscriptions(worker)
            if worker.info is not None:
                for rank in worker.info.ranks:
                    self._index.remove_rank((url, rank.rank))
        if added or removed:
            self._in_url_order = sorted(self.workers.values(), key=lambda w: w.url)
            self._rebuild_table()

    def _rebuild_table(self) -> None:
        self._table.rebuild(((worker.url, rank.rank), rank, worker.rank_loads.get(rank.rank))
                            for worker in self._in_url_order if worker.info is not None for rank in worker.info.ranks)
        self._views.clear()

    async def _check(self, worker: WorkerState) -> None:
        try:
            health = await worker.client.health()
            info = worker.info or await worker.client.info()
            load_report = await worker.client.load()
        except WorkerUnavailable as error:
            self._fail(worker, str(error), error.timed_out)
            return
        except ValueError as error:  # msgspec could not decode the answer
            self._fail(worker, str(error), timed_out=False)
            return
        if self._passed_check(worker, health, info, load_report):
            logger.info("worker %s admitted (%s, %d ranks)", worker.url, worker.info.role, len(worker.info.ranks))
            self._start_kv_subscriptions(worker)

    def _passed_check(self, worker: WorkerState, health: WorkerHealth, info: WorkerInfo,
                      load_report: LoadReport) -> bool:
        """Take in what a health check found; True if that admits the worker."""
        was_routable, had_info = worker.routable, worker.info
        worker.health, worker.info = health, info
        worker.rank_loads = {load.rank: load for load in load_report.ranks}
        worker.consecutive_failures = 0
        worker.suspect = False
        admitted = not worker.admitted
        worker.admitted = True
        if worker.info is not had_info:
            self._rebuild_table()
        else:
            for load in load_report.ranks:
                self._table.set_load((worker.url, load.rank), load)
            if worker.routable != was_routable:
                self._views.clear()
        return admitted

    def _fail(self, worker: WorkerState, reason: str, timed_out: bool) -> None:
        """A worker that refuses connections or answers wrongly is gone: ejected after `eject_after_failures` checks.
        One that only answers too slowly (a saturated CPU, a long pause) is probably still serving its streams:
        ejected once it has stayed unresponsive for `eject_unresponsive_after_s`, so load alone does not take every
        worker out of the pool at once."""
        now = time.monotonic()
        worker.consecutive_failures += 1
        if worker.consecutive_failures == 1:
            worker.failing_since_s = now
        waiting = timed_out and now - worker.failing_since_s < self._eject_unresponsive_after_s
        if worker.admitted and worker.consecutive_failures >= self._eject_after_failures and not waiting:
            logger.warning("worker %s ejected: %s", worker.url, reason)
            worker.admitted = False
            worker.info = None  # a worker that returns may have restarted with other settings
            worker.rank_loads = {}
            self._rebuild_table()
            self._stop_kv_subscriptions(worker)
            self._metrics.count_ejection(worker.url)

    def _start_kv_subscriptions(self, worker: WorkerState) -> None:
        if worker.info.role not in ("prefill", "both"):
            return
        for rank in worker.info.ranks:
            key = (worker.url, rank.rank)
            self._index.add_rank(key, rank.page_size)
            self._index.mark_lost(key)  # (re)admitted: what it holds is unknown until a full dump
            worker.kv_tasks.append(asyncio.create_task(self._follow_kv_events(worker, rank.rank), name=f"kv-{key}"))

    def _stop_kv_subscriptions(self, worker: WorkerState) -> None:
        for task in worker.kv_tasks:
            task.cancel()
        worker.kv_tasks = []

    async def _follow_kv_events(self, worker: WorkerState, rank: int) -> None:
        key = (worker.url, rank)
        while True:
            try:
                batches = worker.client.kv_events(rank, self._index.subscribe_after(key))
                async with contextlib.aclosing(batches):
                    async for batch in batches:
                        outcome = self._index.apply(key, batch)
                        if outcome == "applied":
                            self._metrics.count_kv_events(batch.events)
                        elif outcome == "gap":
                            logger.info("KV event gap on %s; resyncing from a full dump", key)
                            break
            except (WorkerUnavailable, ValueError) as error:
                logger.debug("KV event stream of %s broke: %r", key, error)
            await asyncio.sleep(KV_RESUBSCRIBE_DELAY_S)
