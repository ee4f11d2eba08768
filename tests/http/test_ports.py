"""Ports picked ahead of their listeners lie outside the range outgoing connections take theirs from, and are free."""

import secrets
import socket

from pdserve.http.ports import PICKED_PORTS_FROM, ephemeral_ports_start, free_port


def test_picked_ports_are_free_and_below_the_ephemeral_range():
    below = ephemeral_ports_start()
    ports = {free_port() for _ in range(20)}
    assert all(PICKED_PORTS_FROM <= port < below for port in ports)
    assert len(ports) > 1  # drawn, not one port every time
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_drawn_again(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        real_draw = secrets.randbelow
        draws = iter([taken - PICKED_PORTS_FROM])  # the first draw hits the port in use
        monkeypatch.setattr(secrets, "randbelow", lambda n: next(draws, None) or real_draw(n))
        port = free_port()
        assert port != taken and PICKED_PORTS_FROM <= port < ephemeral_ports_start()
        assert next(draws, "drawn") == "drawn"
