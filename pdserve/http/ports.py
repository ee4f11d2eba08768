"""Ports picked for listeners that bind them later (a worker, a router, a process group's store)."""

import secrets
import socket
from pathlib import Path

# Ports handed out ahead of their listeners come from below the kernel's ephemeral range, where no outgoing
# connection takes its local port (one did: a router then failed to bind the port picked for it, as Ray's processes
# connected meanwhile), and above Ray's worker ports (10002-19999).
PICKED_PORTS_FROM = 20000


def ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now at `host`, which no outgoing connection will take before its listener binds it."""
    below = ephemeral_ports_start()
    for _ in range(100):
        # secrets, not the global random: a test may have seeded that, and another process drawn the same ports
        span = below - PICKED_PORTS_FROM
        port = PICKED_PORTS_FROM + secrets.randbelow(span) if span > 1000 else 0
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise OSError(f"no free port in [{PICKED_PORTS_FROM}, {below})")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listener could bind `port` at `host` now (with SO_REUSEADDR, as uvicorn binds: a closed connection
    still in TIME_WAIT does not hold the port)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
