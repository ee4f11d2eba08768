"""A real Prometheus server on 127.0.0.1 for tests: started from a config, queried with `promtool query`.

Needs the `prometheus` and `promtool` binaries (Debian package `prometheus`). Debian builds them without
Kubernetes service discovery, so configs given here must use static targets (deploy.prometheus.static_scrape_job).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.http.ports import free_port


def prometheus_available() -> bool:
    return shutil.which("prometheus") is not None and shutil.which("promtool") is not None


class LocalPrometheus:
    """`with LocalPrometheus(config_text, work_dir) as prom: prom.wait_for_data(expr, timeout_s=30)`."""

    def __init__(self, config_text: str, work_dir: Path, *, ready_timeout_s: float = 30.0) -> None:
        self.config_path = work_dir / "prometheus.yml"
        self.storage_dir = work_dir / "tsdb"
        self.config_path.write_text(config_text)
        self.ready_timeout_s = ready_timeout_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work_dir / "prometheus.log"
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LocalPrometheus:
        log = self.log_path.open("wb")
        self._process = subprocess.Popen(
            ["prometheus", f"--config.file={self.config_path}", f"--storage.tsdb.path={self.storage_dir}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        self._wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=10)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._process.returncode}: {self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {self.ready_timeout_s}s: {self.log_path.read_text()}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant-query result vector (`[{"metric": {...}, "value": [t, "v"]}]`) through `promtool query`."""
        out = subprocess.run(
            ["promtool", "query", "instant", "-o", "json", self.url, expr],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
        result: list[dict[str, Any]] = json.loads(out) if out.strip() else []
        return result

    def wait_for_data(self, expr: str, *, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Poll `expr` until it returns a sample that is a number (not NaN); raise TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            samples = [s for s in self.query(expr) if s["value"][1] not in ("NaN", "+Inf", "-Inf")]
            if samples:
                return samples
            if time.monotonic() > deadline:
                raise TimeoutError(f"no data for {expr!r} within {timeout_s}s")
            time.sleep(0.5)
