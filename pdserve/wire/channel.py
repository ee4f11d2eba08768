"""The worker channel: generate streams between a worker and its callers (the router, decode workers calling prefill
workers) over one long-lived TCP connection per caller and worker, many streams multiplexed by a stream id, instead
of one HTTP request per generate (it costs a caller ~140 us less CPU a generate than aiohttp, measured on the 2-core
machine: docs/benchmarks.md).

A frame is a 4-byte big-endian length and one msgpack message (msgspec). The caller's first frame is a Hello with the
deployment's internal credential; until it is in, the worker takes frames of at most HELLO_MAX_FRAME_BYTES and
waits HELLO_TIMEOUT_S. Anything else (no hello, a wrong token, a frame over the bound, one that does not decode, a
message out of place) closes the connection without serving it. The caller then sends Generate (a new stream) and
Cancel (stop one: the worker closes the rank's stream, which aborts the request); the worker answers each stream with
Events until the one whose last event has a finish_reason, or a Refusal before any event (the status the HTTP route
would answer), or End (its stream ended without finishing). Frames a side sends within one turn of its event loop go
out in one write."""

import asyncio
import struct

import msgspec

from pdserve.wire.protocol import API_VERSION, GenerateRequest, TokenEvent

MAX_FRAME_BYTES = 16 * 2**20  # a prompt of 128k token ids is ~0.6 MB of msgpack
HELLO_MAX_FRAME_BYTES = 4096
HELLO_TIMEOUT_S = 5.0
_LENGTH = struct.Struct("!I")


class Hello(msgspec.Struct, tag="hello", array_like=True):
    token: str
    api_version: int = API_VERSION


class Generate(msgspec.Struct, tag="generate", array_like=True):
    stream: int
    request: GenerateRequest


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    stream: int


class Events(msgspec.Struct, tag="events", array_like=True):
    stream: int
    events: list[TokenEvent]


class Refusal(msgspec.Struct, tag="refusal", array_like=True):
    """The worker did not take the stream (stream 0: the connection; it closes after this)."""

    stream: int
    status: int  # the HTTP status /internal/v1/generate would answer: 400, 401, 403, 502, 503
    message: str


class End(msgspec.Struct, tag="end", array_like=True):
    stream: int


ToWorker = Hello | Generate | Cancel
FromWorker = Events | Refusal | End


class GenerateRefused(Exception):
    """A worker does not take a generate: its status and why (a Refusal frame, or the HTTP route's error answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class FramedProtocol(asyncio.Protocol):
    """Length-prefixed msgpack frames both ways over one TCP connection. Frames sent within one turn of the loop are
    written together at the turn's end; a frame over the size bound, or one that does not decode, is a violation:
    the connection is cut and `frame_received` sees nothing more."""

    def __init__(self, message_type: type, max_frame_bytes: int) -> None:
        self._decode = msgspec.msgpack.Decoder(message_type).decode
        self._encode_into = msgspec.msgpack.Encoder().encode_into
        self.max_frame_bytes = max_frame_bytes
        self._inbox = bytearray()
        self._outbox = bytearray()
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def data_received(self, data: bytes) -> None:
        inbox = self._inbox
        inbox += data
        start, end = 0, len(inbox)
        try:
            while end - start >= 4 and self.open:
                (size,) = _LENGTH.unpack_from(inbox, start)
                if size > self.max_frame_bytes:
                    raise ValueError(f"a frame of {size} bytes (at most {self.max_frame_bytes})")
                if end - start - 4 < size:
                    break
                message = self._decode(memoryview(inbox)[start + 4:start + 4 + size])
                start += 4 + size
                self.frame_received(message)
        except (ValueError, msgspec.DecodeError) as error:  # ValidationError is a DecodeError
            self.violation(str(error))
            return
        if start:
            del inbox[:start]

    def frame_received(self, message) -> None:
        raise NotImplementedError

    def violation(self, reason: str) -> None:
        """The peer broke the protocol: cut the connection, unread input and unsent output with it."""
        self._inbox.clear()
        if self.transport is not None:
            self.transport.abort()

    def send(self, message: msgspec.Struct) -> None:
        outbox = self._outbox
        if not outbox:
            self._loop.call_soon(self._flush)
        start = len(outbox)
        outbox += b"\0\0\0\0"
        self._encode_into(message, outbox, start + 4)
        _LENGTH.pack_into(outbox, start, len(outbox) - start - 4)

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, bytearray()  # handed over whole: never written to again
        if self.open:
            self.transport.write(outbox)  # type: ignore[union-attr]

