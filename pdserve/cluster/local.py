"""A whole pdserve cluster on this machine: one Ray instance, prefill/decode (or colocated) worker processes and a
router, each a real process on 127.0.0.1. Used by `pdserve up`, the tests and the benchmarks."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import ray

from pdserve.cluster.layout import (
    ClusterConfig,
    StartedCluster,
    cluster_credential,
    router_flags,
    wait_routable,
    worker_flags,
    worker_slots,
)
from pdserve.http.internal_auth import TOKEN_ENV
from pdserve.http.ports import free_port
from pdserve.worker.rank_actors import connect_ray


@dataclass
class ProcessInfo:
    name: str
    url: str
    command: list[str]
    process: subprocess.Popen | None = None
    log_path: Path | None = None


@dataclass
class LocalCluster(StartedCluster):
    cfg: ClusterConfig
    workers: list[ProcessInfo] = field(default_factory=list)
    router: ProcessInfo | None = None
    ray_address: str = ""
    # The cluster's internal-API credential (layout.cluster_credential), handed to its processes through the
    # environment, never on a command line.
    internal_token: str = field(default_factory=cluster_credential, repr=False)
    _log_dir: Path | None = None
    _owns_ray: bool = False

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def start(self) -> "LocalCluster":
        cfg = self.cfg
        self._log_dir = Path(cfg.log_dir or os.environ.get("TMPDIR", "/tmp")) / f"pdserve-{os.getpid()}-{free_port()}"
        self._log_dir.mkdir(parents=True, exist_ok=True)
        if cfg.ray_address:
            self.ray_address = cfg.ray_address
        else:
            self._owns_ray = not ray.is_initialized()
            if self._owns_ray:
                connect_ray(None)
            self.ray_address = ray.get_runtime_context().gcs_address
        slots = worker_slots(cfg)
        for slot in slots:
            self.workers.append(self._spawn(slot.name, slot.url, [
                "worker", *worker_flags(cfg, slot, slots), "--ray-address", self.ray_address]))
        deadline = time.monotonic() + cfg.start_timeout_s
        for worker in self.workers:
            self._wait_healthy(worker, deadline)
        router_port = cfg.port or free_port()
        self.router = self._spawn("router", f"http://127.0.0.1:{router_port}", [
            "router", *router_flags(cfg, [w.url for w in self.workers], router_port)])
        self._wait_healthy(self.router, deadline)
        wait_routable(self.url, len(self.workers), deadline)
        return self

    def _spawn(self, name: str, url: str, args: list[str]) -> ProcessInfo:
        return self._launch(ProcessInfo(name, url, [sys.executable, "-m", "pdserve", *args]))

    def _launch(self, info: ProcessInfo) -> ProcessInfo:
        assert self._log_dir is not None
        info.log_path = self._log_dir / f"{info.name}.log"
        with open(info.log_path, "ab") as log_file:
            info.process = subprocess.Popen(info.command, stdout=log_file, stderr=subprocess.STDOUT,
                                            start_new_session=True, env={**os.environ, TOKEN_ENV: self.internal_token})
        return info

    def _wait_healthy(self, info: ProcessInfo, deadline: float) -> None:
        with httpx.Client(timeout=1.0) as http:  # one client: each new one loads the CA bundle, ~40 ms of CPU
            while time.monotonic() < deadline:
                assert info.process is not None
                if info.process.poll() is not None:
                    raise RuntimeError(f"{info.name} exited with {info.process.returncode}; log: {info.log_path}\n"
                                       + self.log_tail(info))
                try:
                    if http.get(info.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        raise TimeoutError(f"{info.name} not healthy within {self.cfg.start_timeout_s} s; log: {info.log_path}")

    def log_tail(self, info: ProcessInfo, lines: int = 30) -> str:
        if info.log_path is None or not info.log_path.exists():
            return ""
        return "\n".join(info.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self, info: ProcessInfo, sig: int = signal.SIGKILL) -> None:
        """Kill one process (and the processes it started) as a fault would."""
        if info.process is not None and info.process.poll() is None:
            os.killpg(info.process.pid, sig)
            info.process.wait(timeout=30)

    def restart(self, info: ProcessInfo, timeout_s: float = 300.0) -> None:
        self.kill(info)
        self._launch(info)
        self._wait_healthy(info, time.monotonic() + timeout_s)

    def stop(self) -> None:
        processes = ([self.router] if self.router else []) + self.workers
        for info in processes:
            if info.process is not None and info.process.poll() is None:
                os.killpg(info.process.pid, signal.SIGTERM)
        for info in processes:
            if info.process is None:
                continue
            try:
                info.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(info.process.pid, signal.SIGKILL)
                info.process.wait(timeout=15)
        if self._owns_ray:
            ray.shutdown()
