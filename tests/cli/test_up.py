"""`pdserve up` (the README's first command) brings a cluster up, serves a completion, and Ctrl-C stops every process."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from probes import HTTP, metric_total

from pdserve.http.ports import free_port


def start_up(model: str, port: int, log_dir: Path, env: dict[str, str] | None = None,
             extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """`pdserve up` in its own session, output piped (stderr with stdout)."""
    return subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--model", model, "--port", str(port),
                             "--log-dir", str(log_dir), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)


def read_until_up(up: subprocess.Popen, timeout_s: float) -> str:
    """What `pdserve up` printed up to its "Ctrl-C" line, which it prints once the cluster serves."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not any("Ctrl-C" in line for line in lines):
        line = up.stdout.readline()
        assert line or up.poll() is None, "".join(lines)
        lines.append(line)
    return "".join(lines)


def stop_up(up: subprocess.Popen) -> None:
    """After a failed test: SIGTERM first, which stops the cluster's processes too (SIGKILL would orphan them)."""
    if up.poll() is None:
        up.terminate()
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)


def test_up_serves_and_ctrl_c_leaves_no_process_behind(tiny_v2, tmp_path):
    port = free_port()
    up = start_up(tiny_v2, port, tmp_path, extra=("--worker-args", "--num-pages 64 --host-kv-cache-gib 0.05"))
    try:
        output = read_until_up(up, 240)
        assert f"router:  http://127.0.0.1:{port}" in output, output
        worker_urls = re.findall(r"^(?:prefill|decode)-0: (http://\S+)", output, re.M)
        assert len(worker_urls) == 2, output
        # quiet by default: its own lines only (Ray announced its token authentication here once)
        assert all(line.startswith(("pdserve up:", "router:", "prefill-0:", "decode-0:", "try:", "Ctrl-C"))
                   for line in output.splitlines()), output
        model = HTTP.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
        reply = HTTP.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": model, "prompt": "The quick brown fox", "max_tokens": 5})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
        for url in worker_urls:  # --worker-args reached every worker
            assert metric_total(url, "pdserve_kv_cache_pages") == 64
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        for url in [f"http://127.0.0.1:{port}", *worker_urls]:
            try:
                HTTP.get(url + "/health", timeout=2)
                raise AssertionError(f"{url} still answers after Ctrl-C")
            except httpx.HTTPError:
                pass
    finally:
        stop_up(up)


@pytest.mark.parametrize(("flags", "message"), [
    (("--worker-args", "--bogus 1"), "--worker-args: unknown flag(s) --bogus 1"),
    (("--worker-args", "--host-kv-cache-gib -1"), "--worker-args: host_kv_cache_gib must be >= 0"),
    (("--worker-args=--port=9",), "--worker-args: --port=9 is set by pdserve up (use its own flags)"),
    (("--router-args", "--max-n zero"), "--router-args: argument --max-n: invalid int value: 'zero'"),
])
def test_bad_extra_flags_are_one_usage_line_before_anything_starts(tiny_v2, flags, message):
    up = subprocess.run([sys.executable, "-m", "pdserve", "up", "--model", tiny_v2, "--port", str(free_port()), *flags],
                        capture_output=True, text=True, timeout=60)
    assert up.returncode == 2 and up.stderr == f"pdserve up: error: {message}\n", up.stderr
    assert "starting" not in up.stdout


def test_a_worker_that_dies_at_start_ends_up_with_one_error_line_and_its_log(tiny_v2, tmp_path, ray_address):
    """Weights that cannot be read (a truncated file passes the start's check, the rank's load fails): `pdserve up`
    exits 1 with one line naming the worker and its log, followed by that log's tail (the cause), and no traceback of
    its own. It joins the test run's Ray (ray.init reads RAY_ADDRESS) instead of starting one."""
    model = tmp_path / "model"
    model.mkdir()
    for name in os.listdir(tiny_v2):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_v2, name), model / name)
    (model / "model.safetensors").write_bytes(b"")
    up = subprocess.run([sys.executable, "-m", "pdserve", "up", "--model", str(model), "--port", str(free_port()),
                         "--log-dir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=180,
                        env={**os.environ, "RAY_ADDRESS": ray_address})
    assert up.returncode == 1, up.stdout + up.stderr
    first = next(line for line in up.stderr.splitlines() if line.startswith("pdserve up: error: "))
    assert re.fullmatch(r"pdserve up: error: (prefill|decode)-0 exited with 1; log: \S+\.log", first), first
    assert "SafetensorError" in up.stderr  # the cause, from the worker's log
    assert 'pdserve/cli/up.py", line' not in up.stderr


def processes_running(*needles: str) -> list[str]:
    """Command lines of this machine's live processes that contain every one of `needles`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_text().replace("\0", " ") if proc.name.isdigit() else ""
            if cmdline and all(needle in cmdline for needle in needles):
                if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":  # a zombie is already gone
                    found.append(cmdline)
        except OSError:
            pass
    return found


def test_sigterm_while_starting_stops_at_once_and_leaves_no_worker(tiny_v2, tmp_path, ray_address):
    """SIGTERM (what systemd and container runtimes send; Ctrl-C's SIGINT takes the same handler) before the cluster
    is up stops what has started and exits 130 within seconds. Before, the handler `pdserve up` set was replaced by
    ray.init's, which exited 15 (joined to a running Ray, as here) or aborted 3 s later (exit -6, with a Ray of its
    own), in neither case through the command's clean-up; and a Ctrl-C while starting let the start finish, print where
    to send requests, and only then stop."""
    model = tmp_path / "model-for-this-test"  # its path marks this test's workers among the machine's processes
    shutil.copytree(tiny_v2, model)
    up = start_up(str(model), free_port(), tmp_path / "logs", env={**os.environ, "RAY_ADDRESS": ray_address})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(processes_running(" worker ", str(model))) < 2:
            time.sleep(0.05)
        assert len(processes_running(" worker ", str(model))) == 2
        up.send_signal(signal.SIGTERM)
        output = up.communicate(timeout=60)[0]
        assert up.returncode == 130, output
        assert "stopped before the cluster was up" in output and "Ctrl-C stops everything" not in output
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and processes_running(str(model)):
            time.sleep(0.1)
        assert not processes_running(str(model))
    finally:
        stop_up(up)
