"""A whole cluster in this process: the router and every worker behind real HTTP on 127.0.0.1, each worker's ranks
driven in process (no Ray actor, no subprocess), KV handed between pools over NIXL as between processes. The parts are
configured from the same flags as `pdserve worker` and `pdserve router`, and are the same apps; only the process
boundary is gone. For tests and tools that need no process to die: it starts in seconds, not in a process start,
a Ray actor and a model load per worker (the kill, freeze and drain tests keep local.py's processes).

All the HTTP servers share one event loop, on a thread of its own; each rank steps its engine on its own thread as
in a worker process. With `transfer="inprocess"` KV moves by copies between the pools instead of over NIXL.
Expert-parallel workers need a process per rank and are refused."""

import argparse
import asyncio
import dataclasses
import logging
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
import uvicorn

from pdserve.cluster.layout import (
    ClusterConfig,
    PoolFiles,
    StartedCluster,
    WorkerSlot,
    cluster_credential,
    listening_socket,
    router_flags,
    wait_idle,
    wait_routable,
    worker_flags,
    worker_slots,
)
from pdserve.http.slow_clients import KEEP_ALIVE_S, SlowClientLimits, bounded_http
from pdserve.transfer.backend import OnNotification
from pdserve.transfer.inprocess import InProcessBackend, InProcessFabric
from pdserve.worker.config import add_worker_arguments, worker_config_from_args
from pdserve.worker.drain import SHUTDOWN_AFTER_DRAIN_S, DrainGate
from pdserve.worker.http_app import RankSet, build_worker_app
from pdserve.worker.inprocess_rank import InProcessRank
from pdserve.worker.process import describe_worker, handoff_guard, rank_configs
from pdserve.worker.rank_runtime import RankRuntime

log = logging.getLogger(__name__)
T = TypeVar("T")
STOP_TIMEOUT_S = 30.0
# A worker taken out of the router's view is stopped once it has been idle this long: the router re-reads its
# workers every health interval (1 s by default) and may have routed one last request just before.
REMOVE_QUIET_S = 2.0


@dataclass
class ServedApp:
    """One part of the cluster: a worker or the router, served by uvicorn on the cluster's loop."""

    name: str
    url: str
    server: uvicorn.Server
    task: asyncio.Task | None = None
    ranks: list[InProcessRank] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done()


@dataclass
class InProcessCluster(StartedCluster):
    cfg: ClusterConfig
    workers: list[ServedApp] = field(default_factory=list)
    router: ServedApp | None = None
    # The cluster's internal-API credential (layout.cluster_credential), set on every part's config.
    internal_token: str = field(default_factory=cluster_credential, repr=False)
    # KV between pools: NIXL (UCX), as between processes; or in-process copies (pdserve/transfer/inprocess.py), which
    # keep no thread polling per rank: for hundreds of ranks in one process.
    transfer: Literal["nixl", "inprocess"] = "nixl"
    _fabric: InProcessFabric = field(default_factory=InProcessFabric)
    _pool_files: PoolFiles | None = None  # a scalable cluster's endpoint files
    _draining: set[str] = field(default_factory=set)  # URLs of workers being removed: peers still, not routable
    _joining: set[str] = field(default_factory=set)  # URLs of workers starting: peers already, not routable yet
    _workers_started: dict[str, int] = field(default_factory=dict)  # per role, for the next worker's name
    _membership: threading.Lock = field(default_factory=threading.Lock)  # workers may come and go from many threads
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def start(self) -> "InProcessCluster":
        deadline = time.monotonic() + self.cfg.start_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="inprocess-cluster", daemon=True)
        self._thread.start()
        self.run(self._start_parts(), self.cfg.start_timeout_s)
        wait_routable(self.url, len(self.workers), deadline)
        return self

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run `coroutine` on the cluster's loop (where every part's state may be read safely) and return its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    async def _start_parts(self) -> None:
        cfg = self.cfg
        # Every port is held from the start: starting many workers takes long enough for other sockets to come.
        sockets = [listening_socket() for _ in range(cfg.num_prefill + cfg.num_decode + cfg.num_both)]
        slots = worker_slots(cfg, [sock.getsockname()[1] for sock in sockets])
        if cfg.scalable:
            self._pool_files = PoolFiles(tempfile.mkdtemp(prefix="pdserve-pools-"))
            self._pool_files.write([slot.url for slot in slots], [slot.url for slot in slots])
        for slot, sock in zip(slots, sockets):
            self._workers_started[slot.role] = self._workers_started.get(slot.role, 0) + 1
            flags = worker_flags(cfg, slot, slots, self._pool_files)
            self.workers.append(await self._start_worker(slot.name, flags, sock))
        self.router = await self._start_router(listening_socket(cfg.port))

    # --- pools that grow and shrink (ClusterConfig.scalable) --------------------------------------------------------

    def add_worker(self, role: str) -> ServedApp:
        """Start one more worker of `role` and put it in the router's view; returns once it serves HTTP (the router
        admits it at its next health check)."""
        files = self._require_pool_files()
        sock = listening_socket()
        with self._membership:
            index = self._workers_started.get(role, 0)
            self._workers_started[role] = index + 1
            slot = WorkerSlot(f"{role}-{index}", role, sock.getsockname()[1])
            self._joining.add(slot.url)
            self._write_pools()
        try:
            worker = self.run(self._start_worker(slot.name, worker_flags(self.cfg, slot, [], files), sock),
                              self.cfg.start_timeout_s)
            with self._membership:
                self.workers.append(worker)
        finally:
            with self._membership:
                self._joining.discard(slot.url)
                self._write_pools()
        return worker

    def remove_worker(self, worker: ServedApp, drain_timeout_s: float = 60.0) -> bool:
        """Take `worker` out of the router's view, let what it runs finish (at most `drain_timeout_s`), then stop
        it. True if it drained; False if it was stopped with work still on it."""
        self._require_pool_files()
        with self._membership:
            self._draining.add(worker.url)
            self._write_pools()
        drained = wait_idle(worker.url, self.internal_token, REMOVE_QUIET_S, time.monotonic() + drain_timeout_s)
        with self._membership:
            self.workers.remove(worker)
            self._draining.discard(worker.url)
            self._write_pools()
        self.run(self._stop_served([worker]), STOP_TIMEOUT_S + 1)
        for rank in worker.ranks:
            rank.stop()
        return drained

    def kill(self, worker: ServedApp) -> None:
        """Stop serving `worker` as a killed process would: its server closes, and the router is not told (its health
        checks find out); its ranks end with the cluster."""
        self.run(self._stop_served([worker]), STOP_TIMEOUT_S + 1)

    def _require_pool_files(self) -> PoolFiles:
        if self._pool_files is None:
            raise ValueError("this cluster's pools are fixed: start it with ClusterConfig(scalable=True)")
        return self._pool_files

    def _write_pools(self) -> None:
        peers = [worker.url for worker in self.workers] + sorted(self._joining)
        routable = [worker.url for worker in self.workers if worker.url not in self._draining]
        self._require_pool_files().write(routable, peers)

    def restart_router(self) -> None:
        """A new router on the same port, knowing nothing of the old one's state (as after its process restarted)."""
        assert self.router is not None
        port = int(self.router.url.rsplit(":", 1)[1])
        self.run(self._stop_served([self.router]), STOP_TIMEOUT_S + 1)
        self.router = self.run(self._start_router(listening_socket(port)), self.cfg.start_timeout_s)
        wait_routable(self.url, len(self.workers), time.monotonic() + self.cfg.start_timeout_s)

    async def _start_worker(self, name: str, flags: list[str], sock: socket.socket) -> ServedApp:
        parser = argparse.ArgumentParser()
        add_worker_arguments(parser)
        args = parser.parse_args(flags)
        worker = dataclasses.replace(worker_config_from_args(args, args.model), internal_token=self.internal_token)
        if worker.expert_parallel:
            raise ValueError("an expert-parallel worker needs a process per rank: use LocalCluster")
        started = time.monotonic()
        # Loading a model blocks; off the loop, so that parts already serving go on answering.
        open_backend = None if self.transfer == "nixl" else self._open_inprocess_backend
        runtimes = [await asyncio.to_thread(RankRuntime, rank, open_backend) for rank in rank_configs(worker)]
        ranks = [InProcessRank(runtime) for runtime in runtimes]
        info, ready_s = await describe_worker(worker, ranks, started)
        app = build_worker_app(worker, RankSet(ranks, stuck_after_s=worker.stuck_step_timeout_s), info,
                               handoff_guard(worker), DrainGate(), ready_s)
        served = await self._serve(name, worker.url, app, bounded_http(SlowClientLimits(worker.request_read_timeout_s)),
                                   sock)
        served.ranks = ranks
        return served

    def _open_inprocess_backend(self, name: str, kv: torch.Tensor, on_notification: OnNotification) -> InProcessBackend:
        return InProcessBackend(name, kv, on_notification, self._fabric)

    async def _start_router(self, sock: socket.socket) -> ServedApp:
        from pdserve_router.app import build_router_app
        from pdserve_router.config import add_router_arguments, router_config_from_args
        from pdserve_router.hot_routes import hot_route_http

        parser = argparse.ArgumentParser()
        add_router_arguments(parser)
        port = sock.getsockname()[1]
        args = parser.parse_args(router_flags(self.cfg, [w.url for w in self.workers], port, self._pool_files))
        config = dataclasses.replace(router_config_from_args(args), internal_token=self.internal_token)
        limits = SlowClientLimits(config.request_read_timeout_s, config.send_stall_timeout_s)
        app = build_router_app(config)
        return await self._serve("router", f"http://127.0.0.1:{port}", app, hot_route_http(limits, app), sock)

    @staticmethod
    async def _serve(name: str, url: str, app: Any, protocol: type[asyncio.Protocol], sock: socket.socket) -> ServedApp:
        # log_config None: uvicorn leaves this process's logging alone, and its errors reach the root logger. Streams
        # that never end by themselves (a prefill worker's KV-event subscriptions) are cut on stop, as in a process.
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", log_config=None, http=protocol,
                                                timeout_keep_alive=KEEP_ALIVE_S,
                                                timeout_graceful_shutdown=SHUTDOWN_AFTER_DRAIN_S))
        served = ServedApp(name, url, server, asyncio.create_task(server.serve(sockets=[sock]), name=name))
        while not server.started:
            if served.task.done():  # it could not bind, or its startup failed
                raise RuntimeError(f"{name} did not start: {served.task.exception()!r}")
            await asyncio.sleep(0.02)
        return served

    def stop(self) -> None:
        if self._loop is None:
            return
        try:
            self.run(self._stop_parts(), STOP_TIMEOUT_S)
        finally:
            for worker in self.workers:
                for rank in worker.ranks:
                    rank.stop()
            self._loop.call_soon_threadsafe(self._loop.stop)
            assert self._thread is not None
            self._thread.join(STOP_TIMEOUT_S)
            if not self._thread.is_alive():
                self._loop.close()
            self._loop = None
            if self._pool_files is not None:
                shutil.rmtree(self._pool_files.directory, ignore_errors=True)

    async def _stop_parts(self) -> None:
        await self._stop_served(([self.router] if self.router else []) + self.workers)

    @staticmethod
    async def _stop_served(parts: list[ServedApp]) -> None:
        for part in parts:
            part.server.should_exit = True
        tasks = [p.task for p in parts if p.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
        for rank in (rank for part in parts for rank in part.ranks):
            await rank.runtime.close_links()
