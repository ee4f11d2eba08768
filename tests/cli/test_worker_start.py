"""`pdserve worker` stopped while its ranks load (a pod deleted during a long weight load, `kill`)."""

import os
import signal
import subprocess
import sys
import time

from pdserve.http.ports import free_port


def test_sigterm_while_the_ranks_load_stops_at_once_with_one_line(tiny_v2, ray_address):
    """Exit 130 within seconds, one line saying so, no crash dump. Before, ray.init's handler took SIGTERM: exit 15
    with abseil's "*** SIGTERM received ***" dump (joined to a running Ray, as here), or an abort 3 s later (a Ray of
    its own)."""
    worker = subprocess.Popen([sys.executable, "-m", "pdserve", "worker", "--model", tiny_v2, "--role", "both",
                               "--port", str(free_port())], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True, env={**os.environ, "RAY_ADDRESS": ray_address})
    try:
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline and not any("loading" in line for line in lines):
            line = worker.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        worker.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        output = "".join(lines) + worker.communicate(timeout=60)[0]
        assert worker.returncode == 130, output
        assert time.monotonic() - sent < 20, output
        assert "pdserve worker: stopped before it was serving" in output
        assert "SIGTERM received" not in output and "Traceback" not in output and "serving on" not in output
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
