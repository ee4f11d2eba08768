"""The worker's side of the worker channel (pdserve/wire/channel.py): a listener whose connections authenticate with
a Hello, then each Generate runs in its own task over a callable the worker gives (its checks, then the rank's
stream), its event batches sent as they come, until the stream ends, the caller cancels it or the connection
goes."""

import asyncio
import contextlib
import hashlib
import hmac
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable

from pdserve.wire.channel import (
    API_VERSION,
    HELLO_MAX_FRAME_BYTES,
    HELLO_TIMEOUT_S,
    MAX_FRAME_BYTES,
    Cancel,
    End,
    Events,
    FramedProtocol,
    Generate,
    GenerateRefused,
    Hello,
    Refusal,
    ToWorker,
)
from pdserve.wire.protocol import GenerateRequest, TokenEvent

log = logging.getLogger(__name__)
# Starts a generate: raises GenerateRefused, or returns its event batches; closed (aclose) when the stream ends early.
StartGenerate = Callable[[GenerateRequest], Awaitable[AsyncGenerator[list[TokenEvent], None]]]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class ChannelServer:
    """The channel's listener in the running loop; `close` cuts every connection and the streams on them."""

    def __init__(self, token: str, start: StartGenerate) -> None:
        if not token:
            raise ValueError("the worker channel needs a non-empty credential")
        self.token_digest = _digest(token)
        self.start = start
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None

    async def serve(self, host: str, port: int) -> int:
        """Listen on `host`:`port` (0: a port the OS picks); returns the port."""
        self._server = await asyncio.get_running_loop().create_server(lambda: _Connection(self), host, port)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [task for connection in self.connections for task in connection.streams.values()]
        for connection in list(self.connections):
            connection.violation("the worker is shutting down")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Connection(FramedProtocol):
    def __init__(self, server: ChannelServer) -> None:
        super().__init__(ToWorker, HELLO_MAX_FRAME_BYTES)  # raised to MAX_FRAME_BYTES by the hello
        self._server = server
        self.streams: dict[int, asyncio.Task] = {}
        self._authenticated = False
        self._resumed: asyncio.Future | None = None  # set while the transport's buffer is full
        self._hello_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._server.connections.add(self)
        self._hello_timer = self._loop.call_later(HELLO_TIMEOUT_S, self.violation, "no hello in time")

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        for task in self.streams.values():  # each closes its rank stream: the rank aborts the request
            task.cancel()
        self.resume_writing()

    def pause_writing(self) -> None:
        self._resumed = self._loop.create_future()

    def resume_writing(self) -> None:
        resumed, self._resumed = self._resumed, None
        if resumed is not None and not resumed.done():
            resumed.set_result(None)

    def frame_received(self, message) -> None:
        if not self._authenticated:
            self._hello(message)
        elif type(message) is Generate:
            if message.stream in self.streams:
                self.violation(f"stream {message.stream} is already open")
                return
            self.streams[message.stream] = self._loop.create_task(self._serve(message))
        elif type(message) is Cancel:
            task = self.streams.get(message.stream)
            if task is not None:  # else it has ended already
                task.cancel()
        else:
            self.violation("a second hello")

    def _hello(self, message) -> None:
        if type(message) is not Hello or not hmac.compare_digest(_digest(message.token), self._server.token_digest):
            self.violation("no hello with the internal credential first")
            return
        assert self._hello_timer is not None
        self._hello_timer.cancel()
        if message.api_version != API_VERSION:
            self.send(Refusal(0, 400, f"api_version {message.api_version} not supported (this worker speaks "
                                      f"{API_VERSION})"))
            self._loop.call_soon(self.transport.close)  # type: ignore[union-attr]  # after the refusal's write
            return
        self._authenticated = True
        self.max_frame_bytes = MAX_FRAME_BYTES

    async def _serve(self, message: Generate) -> None:
        stream = message.stream
        try:
            try:
                events = await self._server.start(message.request)
            except GenerateRefused as refused:
                self.send(Refusal(stream, refused.status, refused.message))
                return
            except Exception as error:  # noqa: BLE001 - a bug: the caller hears of it at once, not by a timeout
                log.exception("starting %r failed", message.request.request_id)
                self.send(Refusal(stream, 500, f"the worker failed to start the request: {error!r}"))
                return
            finished = False
            try:
                async with contextlib.aclosing(events):
                    async for batch in events:
                        if self._resumed is not None:
                            await asyncio.shield(self._resumed)
                        self.send(Events(stream, batch))
                        finished = finished or any(event.finish_reason is not None for event in batch)
            except Exception:  # noqa: BLE001 - a bug: the caller hears of the stream's end at once, not by a timeout
                log.exception("the stream of %r failed", message.request.request_id)
            if not finished:
                self.send(End(stream))
        finally:
            self.streams.pop(stream, None)
