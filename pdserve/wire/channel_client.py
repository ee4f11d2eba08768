"""The caller's side of the worker channel (pdserve/wire/channel.py): one connection per worker, opened by the first
generate that needs it (its port from the worker's info), shared by every stream to that worker and opened anew
after a break; a break fails only the streams that were on it."""

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable

from yarl import URL

from pdserve.wire.channel import (
    MAX_FRAME_BYTES,
    Cancel,
    End,
    Events,
    FramedProtocol,
    FromWorker,
    Generate,
    GenerateRefused,
    Hello,
    Refusal,
)
from pdserve.wire.protocol import GenerateRequest, TokenEvent

CLOSE_TIMEOUT_S = 5.0
# An idle channel to a worker whose host vanished (no FIN, no RST) is found dead by TCP keepalive within about
# KEEPALIVE_IDLE_S + KEEPALIVE_PROBES * KEEPALIVE_INTERVAL_S, not by the next generate's timeout.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 3


class _Stream:
    __slots__ = ("events", "waiter", "outcome")

    def __init__(self) -> None:
        self.events: list[TokenEvent] = []  # arrived, not yet taken
        self.waiter: asyncio.Future | None = None  # the reader, while it waits
        self.outcome: End | Refusal | str | None = None  # how it ended: End, Refusal, or why the connection broke


def _time_out(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class WorkerChannel(FramedProtocol):
    """One connection to a worker, its streams by id."""

    def __init__(self) -> None:
        super().__init__(FromWorker, MAX_FRAME_BYTES)
        self._streams: dict[int, _Stream] = {}
        self._last_id = 0
        self._broken: str | None = None
        self._retired = False
        self.closed = self._loop.create_future()

    def retire(self) -> None:
        """Take no new streams; close once the open ones have ended (at once if none is open)."""
        self._retired = True
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        if self._retired and not self._streams and self.open:
            self.transport.close()  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        self._broken = self._broken or f"the worker channel closed ({exc!r})"
        for stream in self._streams.values():
            self._end(stream, self._broken)
        if not self.closed.done():
            self.closed.set_result(None)

    def frame_received(self, message) -> None:
        stream = self._streams.get(message.stream)
        if type(message) is Events:
            if stream is not None:  # else a stream the caller has left (cancelled, timed out)
                stream.events += message.events
                if stream.waiter is not None and not stream.waiter.done():
                    stream.waiter.set_result(None)
        elif message.stream == 0 and type(message) is Refusal:  # the connection's: it closes next
            self._broken = f"the worker refused the channel: HTTP {message.status}: {message.message}"
        elif stream is not None:
            self._end(stream, message)

    @staticmethod
    def _end(stream: _Stream, outcome: End | Refusal | str) -> None:
        if stream.outcome is None:
            stream.outcome = outcome
            if stream.waiter is not None and not stream.waiter.done():
                stream.waiter.set_result(None)

    def open_stream(self, request: GenerateRequest) -> int:
        self._last_id += 1
        self._streams[self._last_id] = _Stream()
        self.send(Generate(self._last_id, request))
        return self._last_id

    async def next_events(self, stream_id: int, timeout_s: float) -> list[TokenEvent]:
        """The stream's events that arrived since the last call, waiting up to `timeout_s` for some; [] once the
        worker ended the stream without finishing it. Raises GenerateRefused, ConnectionError (the connection broke)
        or TimeoutError."""
        stream = self._streams[stream_id]
        if not stream.events and stream.outcome is None:
            waiter = stream.waiter = self._loop.create_future()
            timer = self._loop.call_later(timeout_s, _time_out, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                stream.waiter = None
        if stream.events:
            events, stream.events = stream.events, []
            return events
        outcome = stream.outcome
        if isinstance(outcome, str):
            raise ConnectionError(outcome)
        if isinstance(outcome, Refusal):
            raise GenerateRefused(outcome.status, outcome.message)
        return []

    def close_stream(self, stream_id: int) -> None:
        """The caller is done with the stream; one the worker has not ended is cancelled there."""
        stream = self._streams.pop(stream_id, None)
        if stream is not None and stream.outcome is None and self.open:
            self.send(Cancel(stream_id))
        self._close_if_idle()  # an unsent cancel goes with it: a worker ends every stream of a closed connection


class ChannelPool:
    """A process's channels to its workers, by worker URL; made and closed in the loop that uses them."""

    def __init__(self, token: str) -> None:
        self._token = token
        self._channels: dict[str, WorkerChannel] = {}
        self._opening: dict[str, asyncio.Task[WorkerChannel]] = {}
        self._retired: set[WorkerChannel] = set()  # open until their last streams end

    async def channel(self, url: str, port_of: Callable[[], Awaitable[int]], connect_timeout_s: float
                      ) -> WorkerChannel:
        """The open channel to `url`, opened now if there is none (once, however many callers wait for it): raises
        what `port_of` raises, OSError where the port cannot be reached, TimeoutError after `connect_timeout_s`."""
        channel = self._channels.get(url)
        if channel is not None and channel.open:
            return channel
        opening = self._opening.get(url)
        if opening is None:
            opening = self._opening[url] = asyncio.create_task(self._open(url, port_of, connect_timeout_s))
            opening.add_done_callback(lambda task: self._opened(url, task))
        return await asyncio.shield(opening)

    def retire(self, url: str) -> None:
        """The worker at `url` left the pool: its channel closes once the streams on it have ended (a worker being
        drained finishes them); a later generate to `url` opens a new one."""
        channel = self._channels.pop(url, None)
        if channel is not None:
            self._retired.add(channel)
            channel.closed.add_done_callback(lambda _: self._retired.discard(channel))
            channel.retire()

    def _opened(self, url: str, task: asyncio.Task) -> None:
        self._opening.pop(url, None)
        if not task.cancelled():
            task.exception()  # retrieved: a failure no caller waits for any more is not logged as lost

    async def _open(self, url: str, port_of: Callable[[], Awaitable[int]], connect_timeout_s: float) -> WorkerChannel:
        async with asyncio.timeout(connect_timeout_s):
            port = await port_of()
            transport, channel = await asyncio.get_running_loop().create_connection(WorkerChannel, URL(url).host, port)
        _keep_alive(transport.get_extra_info("socket"))
        channel.send(Hello(self._token))
        self._channels[url] = channel
        return channel

    async def close(self) -> None:
        """Close every channel (their streams end as broken) and stop the ones being opened."""
        opening = list(self._opening.values())
        for task in opening:
            task.cancel()
        await asyncio.gather(*opening, return_exceptions=True)
        channels, self._channels = [*self._channels.values(), *self._retired], {}
        for channel in channels:
            if channel.transport is not None:
                channel.transport.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_TIMEOUT_S):  # connection_lost follows a close at once
                await asyncio.gather(*(channel.closed for channel in channels))


def _keep_alive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's keepalive timings apply
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
