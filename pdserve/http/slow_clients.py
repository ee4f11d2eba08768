"""Bounds on slow HTTP clients for our uvicorn servers (router and worker). uvicorn's own keep-alive timeout covers
only the idle time between requests: a client may otherwise trickle a request's head or body for ever, or stop
reading a response and hold it (and what serves it) for ever.

- A request's head and body must have arrived `request_read_timeout_s` after its first byte (after the connection
  opened, for a connection's first request); else the client gets a 408 and the connection is closed (the app, if
  it was reading the body, sees the client leave).
- Where `send_stall_timeout_s` is set, a response the client has stopped taking (the transport's send buffer stays
  above its high-water mark for that long) is cut: the connection is aborted, as if the client had left.

An idle kept-alive connection is closed after KEEP_ALIVE_S (uvicorn's default is 5 s), longer than its clients keep
one (httpx: 5 s, the router's worker pool: 30 s): with both at 5 s a client can send a request on a connection the
server is closing that instant, and the request fails with a ReadError (seen in service: the router then took its
only worker for unreachable)."""

import asyncio
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

KEEP_ALIVE_S = 65.0
_TIMEOUT_BODY = b'{"error":{"message":"request not received in time","type":"invalid_request_error","code":"request_timeout"}}'
_REQUEST_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                            b"content-length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))


@dataclass(frozen=True)
class SlowClientLimits:
    request_read_timeout_s: float = 30.0
    send_stall_timeout_s: float | None = None  # None: a response may wait on its client for as long as it takes

    def __post_init__(self) -> None:
        if self.request_read_timeout_s <= 0 or (self.send_stall_timeout_s is not None and self.send_stall_timeout_s <= 0):
            raise ValueError(f"slow-client timeouts must be > 0, got {self}")


class SlowClientBoundedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol (its C parser; uvloop runs the loop) plus the two bounds; build a subclass with
    its limits through `bounded_http`."""

    limits = SlowClientLimits()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._send_deadline: asyncio.TimerHandle | None = None

    # --- the request must arrive in time ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read_deadline()

    def on_message_begin(self) -> None:  # the parser saw a request's first byte (the next one on a kept-alive connection)
        super().on_message_begin()
        self._arm_read_deadline()

    def on_message_complete(self) -> None:  # all of it is here
        super().on_message_complete()
        self._cancel_read_deadline()

    def _arm_read_deadline(self) -> None:
        if self._read_deadline is None:
            self._read_deadline = self.loop.call_later(self.limits.request_read_timeout_s, self._on_read_timeout)

    def _cancel_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _on_read_timeout(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        # Head incomplete (the cycle, if any, is the previous request's, complete) or the app's response not begun:
        # say why. An app reading the body then gets `http.disconnect` from connection_lost, and whatever it sends
        # after is dropped.
        cycle = self.cycle
        answered = cycle is not None and cycle.response_started and not cycle.response_complete
        if not answered:
            self.transport.write(_REQUEST_TIMEOUT_RESPONSE)
        self.transport.abort()  # close() would wait for a client that may never read

    # --- the response must be taken ---------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.limits.send_stall_timeout_s is not None and self._send_deadline is None:
            self._send_deadline = self.loop.call_later(self.limits.send_stall_timeout_s, self.transport.abort)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_send_deadline()

    def _cancel_send_deadline(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_deadline()
        self._cancel_send_deadline()
        super().connection_lost(exc)


def bounded_http(limits: SlowClientLimits) -> type[SlowClientBoundedHttpTools]:
    """What to pass as uvicorn's `http=`: the httptools protocol with these limits."""
    return type("SlowClientBoundedHttpTools", (SlowClientBoundedHttpTools,), {"limits": limits})


async def client_left(request: Request, error: ClientDisconnect) -> Response:
    """Exception handler for both apps: the client left (or a bound above cut it) while sending its body, so nobody
    reads the answer."""
    return Response(status_code=499)
