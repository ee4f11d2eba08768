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

from pdserve.http.internal_auth import TOKEN_ENV


def cluster_credential() -> str:
    """The internal-API credential a cluster hands its parts: $PDSERVE_INTERNAL_TOKEN when set (so a caller that set
    it can reach the workers too), else a fresh one."""
    return os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def listening_socket(port: int = 0) -> socket.socket:
    """A socket bound on 127.0.0.1 (`port` 0: any free port), held from now on so nothing else can take the port."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


def worker_flags(cfg: ClusterConfig, slot: WorkerSlot, slots: list[WorkerSlot]) -> list[str]:
    """`pdserve worker` flags of one worker; every worker may hand KV to every other."""
    return ["--role", slot.role, "--ranks", str(cfg.ranks_per_worker), "--model", cfg.model,
            "--peers", ",".join(s.url for s in slots), *cfg.worker_args,
            "--host", "127.0.0.1", "--port", str(slot.port)]


def router_flags(cfg: ClusterConfig, worker_urls: list[str], port: int) -> list[str]:
    return ["--model", cfg.model, "--workers", ",".join(worker_urls), "--routing", cfg.routing, *cfg.router_args,
            "--host", "127.0.0.1", "--port", str(port)]


def wait_routable(router_url: str, num_workers: int, deadline: float) -> None:
    """The router has learned every worker (health-checked and read their info)."""
    while time.monotonic() < deadline:
        try:
            models = httpx.get(router_url + "/v1/models", timeout=1.0)
            seen = httpx.get(router_url + "/health", timeout=1.0).json().get("workers", {})
            if models.status_code == 200 and sum(state == "ok" for state in seen.values()) >= num_workers:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    raise TimeoutError("router did not see its workers in time")


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
