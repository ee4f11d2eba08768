"""What a cluster on this machine consists of, whichever way it runs (processes: local.py; one process:
inprocess.py): its configuration, its workers' names, roles and ports, the flags each part starts with, and when the
router can route to every worker."""

import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import TypeVar

import httpx

from pdserve.discovery.endpoints import write_endpoints_file
from pdserve.http.internal_auth import TOKEN_ENV, bearer_headers
from pdserve.http.ports import free_port


def cluster_credential() -> str:
    """The internal-API credential a cluster hands its parts: $PDSERVE_INTERNAL_TOKEN when set (so a caller that set
    it can reach the workers too), else a fresh one."""
    return os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)


@dataclass(frozen=True)
class ClusterConfig:
    model: str
    port: int = 8000  # the router's; 0 picks a free one
    num_prefill: int = 1
    num_decode: int = 1
    num_both: int = 0  # colocated workers (role both); with num_prefill = num_decode = 0 the cluster is colocated
    ranks_per_worker: int = 1
    routing: str = "prefix"
    worker_args: tuple[str, ...] = ()  # extra `pdserve worker` flags
    router_args: tuple[str, ...] = ()
    start_timeout_s: float = 300.0
    ray_address: str | None = None  # join this Ray instance; None: start one owned by this cluster (processes only)
    log_dir: str | None = None  # each process's output goes to a file here (default: a temp dir; processes only)
    # Pools may grow and shrink while it runs (the planner): the router and the workers then read who is there from
    # endpoint files (PoolFiles) instead of fixed lists.
    scalable: bool = False

    def __post_init__(self) -> None:
        counts = f"{self.num_prefill} prefill, {self.num_decode} decode, {self.num_both} colocated"
        if min(self.num_prefill, self.num_decode, self.num_both) < 0:
            raise ValueError(f"worker counts must be >= 0: {counts}")
        if self.num_prefill + self.num_decode + self.num_both == 0:
            raise ValueError("a cluster needs at least one worker: prefill and decode, or colocated")
        if (self.num_prefill == 0) != (self.num_decode == 0):
            raise ValueError(f"prefill workers hand their KV to decode workers, so a cluster has both or neither: "
                             f"{counts}")
        if self.ranks_per_worker < 1:
            raise ValueError(f"ranks_per_worker must be >= 1, got {self.ranks_per_worker}")


@dataclass(frozen=True)
class WorkerSlot:
    name: str  # role-index, e.g. prefill-0
    role: str
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def worker_slots(cfg: ClusterConfig, ports: list[int] | None = None) -> list[WorkerSlot]:
    """`ports`: one per worker, already held by the caller (default: free ones now, which another socket of this
    machine may take before the worker binds it)."""
    roles = ["prefill"] * cfg.num_prefill + ["decode"] * cfg.num_decode + ["both"] * cfg.num_both
    ports = ports or [free_port() for _ in roles]
    counts: dict[str, int] = {}
    slots = []
    for role, port in zip(roles, ports, strict=True):
        counts[role] = counts.get(role, -1) + 1
        slots.append(WorkerSlot(f"{role}-{counts[role]}", role, port))
    return slots


@dataclass(frozen=True)
class PoolFiles:
    """A scalable cluster's two endpoint files (FileDiscovery): `workers`, what the router routes to, and `peers`,
    whom a worker may hand KV to or take it from. A worker joins the peers before the router sees it and leaves
    them only after it has drained, so no hand-off in flight is refused."""

    directory: str

    @property
    def workers(self) -> str:
        return os.path.join(self.directory, "workers")

    @property
    def peers(self) -> str:
        return os.path.join(self.directory, "peers")

    def write(self, routable: list[str], peers: list[str]) -> None:
        write_endpoints_file(self.peers, peers)
        write_endpoints_file(self.workers, routable)


def listening_socket(port: int = 0) -> socket.socket:
    """A socket bound on 127.0.0.1 (`port` 0: any free port), held from now on so nothing else can take the port."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


def worker_flags(cfg: ClusterConfig, slot: WorkerSlot, slots: list[WorkerSlot],
                 pool_files: PoolFiles | None = None) -> list[str]:
    """`pdserve worker` flags of one worker; every worker may hand KV to every other."""
    peers = (["--discovery", "file", "--peers-file", pool_files.peers] if pool_files
             else ["--peers", ",".join(s.url for s in slots)])
    return ["--role", slot.role, "--ranks", str(cfg.ranks_per_worker), "--model", cfg.model, *peers, *cfg.worker_args,
            "--host", "127.0.0.1", "--port", str(slot.port)]


def router_flags(cfg: ClusterConfig, worker_urls: list[str], port: int, pool_files: PoolFiles | None = None) -> list[str]:
    workers = (["--discovery", "file", "--workers-file", pool_files.workers] if pool_files
               else ["--workers", ",".join(worker_urls)])
    return ["--model", cfg.model, *workers, "--routing", cfg.routing, *cfg.router_args,
            "--host", "127.0.0.1", "--port", str(port)]


def wait_routable(router_url: str, num_workers: int, deadline: float) -> None:
    """The router has learned every worker (health-checked and read their info)."""
    with httpx.Client(timeout=1.0) as http:  # one client: each new one loads the CA bundle, ~40 ms of CPU
        while time.monotonic() < deadline:
            try:
                models = http.get(router_url + "/v1/models")
                seen = http.get(router_url + "/health").json().get("workers", {})
                if models.status_code == 200 and sum(state == "ok" for state in seen.values()) >= num_workers:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.25)
    raise TimeoutError("router did not see its workers in time")


def wait_idle(worker_url: str, internal_token: str, quiet_s: float, deadline: float) -> bool:
    """The worker has had no request running or waiting on any rank for `quiet_s` (the router, told to stop routing
    to it, has had time to notice); False if that did not happen before `deadline`."""
    idle_since = None
    with httpx.Client(headers=bearer_headers(internal_token), timeout=2.0) as http:
        while time.monotonic() < deadline:
            try:
                ranks = http.get(worker_url + "/internal/v1/load").json()["ranks"]
                busy = any(rank["running"] or rank["waiting"] for rank in ranks)
            except (httpx.HTTPError, ValueError, KeyError):
                busy = True
            now = time.monotonic()
            idle_since = None if busy else (idle_since or now)
            if idle_since is not None and now - idle_since >= quiet_s:
                return True
            time.sleep(0.1)
    return False


Cluster = TypeVar("Cluster", bound="StartedCluster")


class StartedCluster:
    """`with` starts the cluster and stops it after, also when starting failed half-way."""

    def start(self: Cluster) -> Cluster:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: Cluster) -> Cluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
