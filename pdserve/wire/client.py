"""Client of a worker's internal API (pdserve/wire/protocol.py): typed msgspec JSON over one pooled aiohttp session
for the quick calls and KV events, and generate streams over the worker channel (pdserve/wire/channel.py); used by
the router and by decode workers calling prefill workers."""

import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

import aiohttp
import msgspec

from pdserve.wire.channel import GenerateRefused
from pdserve.wire.channel_client import ChannelPool, WorkerChannel
from pdserve.wire.protocol import (
    AbortRequest,
    GenerateRequest,
    KVEventBatch,
    LoadReport,
    Reservation,
    ReservationQuery,
    TokenEvent,
    WorkerHealth,
    WorkerInfo,
    coalesce_events,
)

T = TypeVar("T")
GENERATE_CONNECT_TIMEOUT_S = 5.0  # a busy worker may accept slowly; that is not the quick probe a health check is
# Idle connections are kept 30 s (below a worker's KEEP_ALIVE_S, pdserve/http/slow_clients.py): a request is never
# sent on a connection the worker is closing that instant.
POOL_KEEPALIVE_S = 30.0
_JSON = {"content-type": "application/json"}
# What a call fails with when the worker cannot be reached or answers badly (aiohttp's timeouts are TimeoutErrors).
_TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)


class WorkerSession:
    """What a process keeps open to workers: a pooled aiohttp session for the quick calls and KV events, and the
    channels generate streams run on; `token` is the deployment's internal credential. Both open on first use, in
    the loop that uses them (aiohttp binds its session there), so a session can be built before that loop runs."""

    def __init__(self, token: str = "") -> None:
        self._headers = {"authorization": f"Bearer {token}"} if token else None
        self._http: aiohttp.ClientSession | None = None
        self.channels = ChannelPool(token)
        self.closed = False

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=POOL_KEEPALIVE_S)
            # Workers set no cookies: a jar that keeps none spares filtering and storing them on every call.
            self._http = aiohttp.ClientSession(connector=connector, headers=self._headers, auto_decompress=False,
                                               cookie_jar=aiohttp.DummyCookieJar())
        return self._http

    async def close(self) -> None:
        self.closed = True
        await self.channels.close()
        if self._http is not None:
            await self._http.close()

    async def __aenter__(self) -> "WorkerSession":
        return self

    async def __aexit__(self, *_) -> None:
        await self.close()


class WorkerUnavailable(Exception):
    """The worker could not be reached or answered with an error before streaming anything. `refused` is True when
    the worker certainly never took the request (no connection, or an error status): it will not act on it later.
    `timed_out` is True when it did not answer in time: alive but slow, or hung; not known to be gone."""

    def __init__(self, message: str, refused: bool = False, timed_out: bool = False):
        super().__init__(message)
        self.refused = refused
        self.timed_out = timed_out


def _unreachable(where: str, error: Exception) -> WorkerUnavailable:
    return WorkerUnavailable(f"{where}: {error!r}", refused=isinstance(error, aiohttp.ClientConnectorError),
                             timed_out=isinstance(error, TimeoutError))


async def _ndjson_lines(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The stream's lines, each as soon as it is complete."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer


class WorkerClient:
    def __init__(self, url: str, session: WorkerSession, request_timeout_s: float = 1.0) -> None:
        self.url = url.rstrip("/")
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._timeout_s = request_timeout_s
        self._connect_timeout_s = max(request_timeout_s, GENERATE_CONNECT_TIMEOUT_S)

    async def _call(self, method: str, path: str, body: bytes | None = None,
                    timeout: aiohttp.ClientTimeout | None = None) -> tuple[int, bytes]:
        """One quick call within the request timeout (or `timeout`): its status and whole body."""
        try:
            async with self._session.http.request(method, self.url + path, data=body, timeout=timeout or self._timeout,
                                          headers=_JSON if body is not None else None) as response:
                return response.status, await response.read()
        except _TRANSPORT_ERRORS as error:
            raise _unreachable(f"{self.url}{path}", error) from error

    async def _get(self, path: str, message_type: type[T], timeout: aiohttp.ClientTimeout | None = None) -> T:
        status, content = await self._call("GET", path, timeout=timeout)
        if status != 200:
            raise WorkerUnavailable(f"{self.url}{path}: HTTP {status}")
        return msgspec.json.decode(content, type=message_type)

    async def health(self) -> WorkerHealth:
        """The worker's health; a draining worker (503 `draining`) is answered, not raised: it is alive and finishing
        its requests, it only takes no new ones."""
        status, content = await self._call("GET", "/health")
        if status == 503:
            with contextlib.suppress(msgspec.DecodeError):
                health = msgspec.json.decode(content, type=WorkerHealth)
                if health.status == "draining":
                    return health
        if status != 200:
            raise WorkerUnavailable(f"{self.url}/health: HTTP {status}")
        return msgspec.json.decode(content, type=WorkerHealth)

    async def info(self) -> WorkerInfo:
        return await self._get("/internal/v1/info", WorkerInfo)

    async def load(self) -> LoadReport:
        return await self._get("/internal/v1/load", LoadReport)

    async def abort(self, request_id: str) -> None:
        with contextlib.suppress(WorkerUnavailable):  # the worker is gone or the request finished: nothing to abort
            await self._call("POST", "/internal/v1/abort", msgspec.json.encode(AbortRequest(request_id)))

    async def confirm_reservation(self, query: ReservationQuery) -> Reservation | None:
        """A decode worker's reservation for a prefill plan; None when it refused the query (403)."""
        path = "/internal/v1/transfer/reservation"
        status, content = await self._call("POST", path, msgspec.json.encode(query))
        if status == 403:
            return None
        if status != 200:
            raise WorkerUnavailable(f"{self.url}{path}: HTTP {status}")
        return msgspec.json.decode(content, type=Reservation)

    async def generate(self, request: GenerateRequest, first_token_timeout_s: float) -> AsyncIterator[TokenEvent]:
        """The request's TokenEvents one by one (see generate_batches)."""
        async with contextlib.aclosing(self.generate_batches(request, first_token_timeout_s)) as batches:
            async for batch in batches:
                for event in batch:
                    yield event

    async def generate_batches(self, request: GenerateRequest,
                               first_token_timeout_s: float) -> AsyncIterator[list[TokenEvent]]:
        """Stream the request's TokenEvents over the worker's channel, in batches of what arrived together (a busy
        router forwards each batch in one write). WorkerUnavailable before the first event means nothing was
        generated (safe to retry elsewhere); `first_token_timeout_s` bounds the wait for the first event and every
        later one; a stream that breaks or ends without a finish_reason yields a final error event. Leaving the
        iteration early (aclose) cancels the request on the worker."""
        channel = await self._channel()
        stream = channel.open_stream(request)
        got_event = False
        try:
            while True:
                try:
                    events = await channel.next_events(stream, first_token_timeout_s)
                except GenerateRefused as refused:
                    raise WorkerUnavailable(f"{self.url} generate: HTTP {refused.status}: {refused.message}",
                                            refused=True) from refused
                except (ConnectionError, TimeoutError) as error:
                    if not got_event:
                        raise WorkerUnavailable(f"{self.url} generate: {error!r}",
                                                timed_out=isinstance(error, TimeoutError)) from error
                    yield [TokenEvent(request.request_id, [], finish_reason="error",
                                      error=f"worker stream broke: {error!r}")]
                    return
                if not events:  # the worker ended the stream without finishing it
                    break
                batch = coalesce_events(events)
                got_event = True
                finished = next((i for i, event in enumerate(batch) if event.finish_reason is not None), None)
                if finished is not None:
                    yield batch[:finished + 1]
                    return
                yield batch
        finally:
            channel.close_stream(stream)
        if not got_event:
            raise WorkerUnavailable(f"{self.url} generate: empty stream")
        yield [TokenEvent(request.request_id, [], finish_reason="error", error="worker stream ended without finishing")]

    def retire_channel(self) -> None:
        """The worker left the pool: its channel closes once the streams on it have ended."""
        self._session.channels.retire(self.url)

    async def _channel(self) -> WorkerChannel:
        try:
            return await self._session.channels.channel(self.url, self._channel_port, self._connect_timeout_s)
        except OSError as error:  # not reached (refused: it never saw the request), or not in time
            timed_out = isinstance(error, TimeoutError)
            raise WorkerUnavailable(f"{self.url} generate: {error!r}", refused=not timed_out,
                                    timed_out=timed_out) from error

    async def _channel_port(self) -> int:
        # Asked as a channel opens: bounded by the generate's connect timeout, not the quick calls' one.
        timeout = aiohttp.ClientTimeout(total=self._connect_timeout_s)
        port = (await self._get("/internal/v1/info", WorkerInfo, timeout)).channel_port
        if not port:
            raise ConnectionRefusedError(f"{self.url} serves no worker channel")
        return port

    async def kv_events(self, rank: int, after: int) -> AsyncIterator[KVEventBatch]:
        """The rank's KV event batches from seq `after` + 1 (after=-1: a full dump first); runs until the stream ends."""
        timeout = aiohttp.ClientTimeout(sock_connect=self._timeout_s)
        decoder = msgspec.json.Decoder(KVEventBatch)
        path = "/internal/v1/kv_events"
        try:
            async with self._session.http.get(self.url + path, params={"rank": rank, "after": after},
                                              timeout=timeout) as response:
                if response.status != 200:
                    raise WorkerUnavailable(f"{self.url}{path}: HTTP {response.status}")
                async for line in _ndjson_lines(response):
                    yield decoder.decode(line)
        except _TRANSPORT_ERRORS as error:
            raise _unreachable(f"{self.url}{path}", error) from error
