"""Bounded waits on live processes, shared by the tests of every folder (tests/ is on sys.path via its conftest)."""

import os
import socket
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.http.internal_auth import TOKEN_ENV, bearer_headers

# The tests' HTTP calls. httpx's module functions (httpx.get, ...) build a client a call, and each loads the CA bundle:
# ~40 ms of CPU, a third of a core for a loop polling every 0.1 s, beside the clusters on CI's two cores. One client,
# a new connection a call as before (none kept alive: a test may kill the process behind one).
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def internal_token() -> str:
    """The credential of this test run's clusters (tests/conftest.py sets it)."""
    return os.environ[TOKEN_ENV]


def internal_headers() -> dict[str, str]:
    """internal_token as the header of direct internal-API calls."""
    return bearer_headers(internal_token())


def eventually(check, timeout_s: float = 30.0, interval_s: float = 0.1) -> bool:
    """Whether `check()` held within `timeout_s` (checked once more at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval_s)
    return check()


def wait_for(check, timeout_s: float, what: str, interval_s: float = 0.1):
    """`check()`'s first truthy result; TimeoutError naming `what` when none came within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(interval_s)
    raise TimeoutError(f"{what} within {timeout_s} s")


def health_status(url: str) -> int | None:
    """The HTTP status of `url`/health, or None when nothing answered."""
    try:
        return HTTP.get(url + "/health", timeout=2.0).status_code
    except httpx.HTTPError:
        return None


def metric_total(url: str, name: str) -> float:
    """The sum of every labelled sample named `name` (e.g. `..._total`, `..._sum`) on `url`/metrics; 0 when absent."""
    text = HTTP.get(url + "/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


class Listener:
    """A port on 127.0.0.1 that counts the connections made to it, and either closes each at once (what a forged URL
    would make a worker fetch) or, with `hold`, keeps it open without a word (a worker that never answers)."""

    def __init__(self, hold: bool = False) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._hold, self._held = hold, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            if self._hold:
                self._held.append(connection)
            else:
                connection.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for connection in self._held:
            connection.close()
        self.sock.close()
