"""Client of a worker's internal API (pdserve/wire/protocol.py): typed msgspec JSON over httpx; used by the router and by decode workers calling prefill workers."""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

import httpx
import msgspec

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
)

T = TypeVar("T")
GENERATE_CONNECT_TIMEOUT_S = 5.0  # a busy worker may accept slowly; that is not the quick probe a health check is
DRAIN_AFTER_FINISH_S = 1.0  # bound on reading the end of a finished stream (a worker ends it at once)


class WorkerUnavailable(Exception):
    """The worker could not be reached or answered with an error before streaming anything. `refused` is True when
    the worker certainly never took the request (no connection, or an error status): it will not act on it later.
    `timed_out` is True when it did not answer in time: alive but slow, or hung; not known to be gone."""

    def __init__(self, message: str, refused: bool = False, timed_out: bool = False):
        super().__init__(message)
        self.refused = refused
        self.timed_out = timed_out


def _unreachable(where: str, error: httpx.HTTPError) -> WorkerUnavailable:
    return WorkerUnavailable(f"{where}: {error!r}", timed_out=isinstance(error, httpx.TimeoutException))


async def _ndjson_lines(response: httpx.Response) -> AsyncIterator[bytes]:
    buffer = b""
    async for chunk in response.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer


async def _read_to_end(lines: AsyncIterator[bytes]) -> None:
    """Read what follows a stream's last event (its end, at once from a worker): a response read to its end gives
    its connection back to the pool, one left unread is closed, and the next request pays a new TCP connect."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_AFTER_FINISH_S):
            async for _ in lines:
                pass


class WorkerClient:
    def __init__(self, url: str, http: httpx.AsyncClient, request_timeout_s: float = 1.0) -> None:
        self.url = url.rstrip("/")
        self._http = http
        self._timeout_s = request_timeout_s

    async def _get(self, path: str, message_type: type[T]) -> T:
        try:
            response = await self._http.get(self.url + path, timeout=self._timeout_s)
            response.raise_for_status()
        except httpx.HTTPError as error:
            raise _unreachable(f"{self.url}{path}", error) from error
        return msgspec.json.decode(response.content, type=message_type)

    async def health(self) -> WorkerHealth:
        """The worker's health; a draining worker (503 `draining`) is answered, not raised: it is alive and finishing
        its requests, it only takes no new ones."""
        try:
            response = await self._http.get(self.url + "/health", timeout=self._timeout_s)
        except httpx.HTTPError as error:
            raise _unreachable(f"{self.url}/health", error) from error
        if response.status_code == 503:
            with contextlib.suppress(msgspec.DecodeError):
                health = msgspec.json.decode(response.content, type=WorkerHealth)
                if health.status == "draining":
                    return health
        if response.status_code != 200:
            raise WorkerUnavailable(f"{self.url}/health: HTTP {response.status_code}")
        return msgspec.json.decode(response.content, type=WorkerHealth)

    async def info(self) -> WorkerInfo:
        return await self._get("/internal/v1/info", WorkerInfo)

    async def load(self) -> LoadReport:
        return await self._get("/internal/v1/load", LoadReport)

    async def abort(self, request_id: str) -> None:
        try:
            await self._http.post(
                self.url + "/internal/v1/abort", content=msgspec.json.encode(AbortRequest(request_id)), timeout=self._timeout_s
            )
        except httpx.HTTPError:
            pass  # the worker is gone or the request already finished: nothing left to abort

    async def confirm_reservation(self, query: ReservationQuery) -> Reservation | None:
        """A decode worker's reservation for a prefill plan; None when it refused the query (403)."""
        try:
            response = await self._http.post(self.url + "/internal/v1/transfer/reservation",
                                             content=msgspec.json.encode(query), timeout=self._timeout_s,
                                             headers={"content-type": "application/json"})
        except httpx.HTTPError as error:
            raise _unreachable(f"{self.url}/internal/v1/transfer/reservation", error) from error
        if response.status_code == 403:
            return None
        if response.status_code != 200:
            raise WorkerUnavailable(f"{self.url}/internal/v1/transfer/reservation: HTTP {response.status_code}")
        return msgspec.json.decode(response.content, type=Reservation)

    async def generate(self, request: GenerateRequest, first_token_timeout_s: float) -> AsyncIterator[TokenEvent]:
        """Stream the request's TokenEvents. WorkerUnavailable before the first event means nothing was generated
        (safe to retry elsewhere); a stream that ends without a finish_reason yields a final error event."""
        connect_s = max(self._timeout_s, GENERATE_CONNECT_TIMEOUT_S)
        timeout = httpx.Timeout(connect=connect_s, read=first_token_timeout_s, write=10.0, pool=10.0)
        body = msgspec.json.encode(request)
        decoder = msgspec.json.Decoder(TokenEvent)
        got_event = False
        try:
            async with self._http.stream(
                "POST", self.url + "/internal/v1/generate", content=body, timeout=timeout,
                headers={"content-type": "application/json"},
            ) as response:
                if response.status_code != 200:
                    detail = (await response.aread())[:500].decode(errors="replace")
                    raise WorkerUnavailable(f"{self.url} generate: HTTP {response.status_code}: {detail}", refused=True)
                lines = _ndjson_lines(response)
                async for line in lines:
                    event = decoder.decode(line)
                    got_event = True
                    if event.finish_reason is not None:
                        await _read_to_end(lines)
                        yield event
                        return
                    yield event
        except (httpx.HTTPError, msgspec.DecodeError) as error:
            if not got_event:
                refused = isinstance(error, httpx.ConnectError)
                raise WorkerUnavailable(f"{self.url} generate: {error!r}", refused=refused) from error
            yield TokenEvent(request.request_id, [], finish_reason="error", error=f"worker stream broke: {error!r}")
            return
        if not got_event:
            raise WorkerUnavailable(f"{self.url} generate: empty stream")
        yield TokenEvent(request.request_id, [], finish_reason="error", error="worker stream ended without finishing")

    async def kv_events(self, rank: int, after: int) -> AsyncIterator[KVEventBatch]:
        """The rank's KV event batches from seq `after` + 1 (after=-1: a full dump first); runs until the stream ends."""
        timeout = httpx.Timeout(connect=self._timeout_s, read=None, write=10.0, pool=10.0)
        decoder = msgspec.json.Decoder(KVEventBatch)
        async with self._http.stream(
            "GET", self.url + "/internal/v1/kv_events", params={"rank": rank, "after": after}, timeout=timeout
        ) as response:
            response.raise_for_status()
            async for line in _ndjson_lines(response):
                yield decoder.decode(line)
