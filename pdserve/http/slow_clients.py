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

import h11
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol

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


class SlowClientBoundedH11(H11Protocol):
    """uvicorn's h11 protocol plus the two bounds; build a subclass with its limits through `bounded_h11`."""

    limits = SlowClientLimits()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._send_deadline: asyncio.TimerHandle | None = None

    # --- the request must arrive in time ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read_deadline()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # first bytes of the next request on a kept-alive connection
            self._arm_read_deadline()
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()  # also runs when a response completes, for a pipelined request
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):  # all of it is here (or it was refused)
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
        # Head incomplete (IDLE) or the app's response not begun: say why. An app reading the body then gets
        # `http.disconnect` from connection_lost, and whatever it sends after is dropped.
        answered = self.conn.their_state is h11.SEND_BODY and self.cycle is not None and self.cycle.response_started
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


def bounded_h11(limits: SlowClientLimits) -> type[SlowClientBoundedH11]:
    """What to pass as uvicorn's `http=`: the h11 protocol with these limits."""
    return type("SlowClientBoundedH11", (SlowClientBoundedH11,), {"limits": limits})


async def client_left(request: Request, error: ClientDisconnect) -> Response:
    """Exception handler for both apps: the client left (or a bound above cut it) while sending its body, so nobody
    reads the answer."""
    return Response(status_code=499)
