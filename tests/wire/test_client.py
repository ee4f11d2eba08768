"""WorkerClient against a real HTTP server on 127.0.0.1: finished streams give their connection back to the pool
(one TCP connection for many requests), and a server that keeps a stream open after its last event still has
that event delivered, after the bounded wait for the stream's end."""

import asyncio
import threading
import time

import msgspec
import pytest
import uvicorn

from pdserve.http.ports import free_port
from pdserve.wire import client as client_module
from pdserve.wire.client import LazyWorkerSession, WorkerClient, worker_session
from pdserve.wire.protocol import GenerateRequest, TokenEvent


class Server:
    """Answers generate with three TokenEvents; `hold_open` keeps the stream open after the last one."""

    def __init__(self, hold_open: bool = False) -> None:
        self.hold_open = hold_open
        self.client_ports: set[int] = set()
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                   interface="asgi3"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def app(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        self.client_ports.add(scope["client"][1])
        request = msgspec.json.decode((await receive())["body"], type=GenerateRequest)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-ndjson")]})
        for i in range(3):
            event = TokenEvent(request.request_id, [i], finish_reason="length" if i == 2 else None)
            await send({"type": "http.response.body", "body": msgspec.json.encode(event) + b"\n", "more_body": True})
        if self.hold_open:
            await asyncio.sleep(30)
        await send({"type": "http.response.body", "body": b""})

    def __enter__(self) -> "Server":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *_) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


async def generate_all(url: str, request_ids: list[str]) -> list[list[TokenEvent]]:
    async with worker_session() as http:
        client = WorkerClient(url, http)
        streams = []
        for rid in request_ids:
            streams.append([event async for event in client.generate(GenerateRequest(rid, 0, [1, 2]), 10.0)])
        return streams


def test_finished_streams_reuse_one_connection():
    with Server() as server:
        streams = asyncio.run(generate_all(f"http://127.0.0.1:{server.port}", ["a", "b", "c"]))
    assert [[t for e in events for t in e.token_ids] for events in streams] == [[0, 1, 2]] * 3  # in 1-3 events
    assert [events[-1].finish_reason for events in streams] == ["length"] * 3
    assert len(server.client_ports) == 1  # one TCP connection served all three


def test_a_stream_held_open_after_its_last_event_still_delivers_it(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(client_module, "DRAIN_AFTER_FINISH_S", 0.2)
    with Server(hold_open=True) as server:
        started = time.monotonic()
        streams = asyncio.run(generate_all(f"http://127.0.0.1:{server.port}", ["a"]))
        assert time.monotonic() - started < 10  # not the 30 s the server holds the stream
        server.server.force_exit = True
    assert [t for e in streams[0] for t in e.token_ids] == [0, 1, 2] and streams[0][-1].finish_reason == "length"


def test_a_lazy_session_opens_on_first_use_closes_and_opens_anew_after():
    async def scenario() -> tuple[bool, bool, bool, bool]:
        lazy = LazyWorkerSession()
        await lazy.close()  # never opened: nothing to close
        first = lazy()
        same = lazy() is first
        await lazy.close()
        second = lazy()
        await lazy.close()
        return same, first.closed, second is not first, second.closed

    assert asyncio.run(scenario()) == (True, True, True, True)
