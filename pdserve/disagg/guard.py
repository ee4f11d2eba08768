"""The worker edge's checks on a hand-off plan: a worker hands KV only to and from workers its discovery names (never
a URL the request brings), checked before any rank sees the plan; and a prefill plan must name a reservation that the
decode worker itself confirms, with a write deadline that is set and bounded. The confirm runs while the prefill rank
computes (`worker/prefill_start.py`), and the rank writes nothing before it: everything it then writes (page ids,
deadline, the decode rank's transfer metadata) comes from that confirmation, none of it from the request."""

import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from pdserve.discovery.endpoints import Discovery
from pdserve.wire.client import WorkerUnavailable
from pdserve.wire.protocol import GenerateRequest, Reservation, ReservationQuery

MAX_WRITE_WINDOW_S = 900.0  # a write deadline further ahead than this is refused (the decode side's is ~120 s)
MAX_TRANSFER_TIMEOUT_S = 300.0

# (decode worker URL, query) -> the reservation, or None when that worker refused the query
ConfirmReservation = Callable[[str, ReservationQuery], Awaitable[Reservation | None]]


class HandoffRefused(Exception):
    def __init__(self, message: str, status: int = 403):
        super().__init__(message)
        self.status = status


def _worker_key(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url.strip())
    default_port = {"http": 80, "https": 443}.get(parts.scheme.lower())
    try:
        port = parts.port or default_port
    except ValueError:  # a port that is not a number
        port = None
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


class HandoffGuard:
    def __init__(self, peers: Discovery, confirm_at: ConfirmReservation, max_write_window_s: float = MAX_WRITE_WINDOW_S,
                 close: Callable[[], Awaitable[None]] | None = None):
        """`close`: releases what `confirm_at` holds (its connections), when the worker stops."""
        self._peers = peers
        self._confirm_at = confirm_at
        self._max_write_window_s = max_write_window_s
        self._close = close

    async def close(self) -> None:
        if self._close is not None:
            await self._close()

    def known_peer(self, url: str) -> str | None:
        """The peer's URL as discovery names it, or None when `url` names no worker discovery knows."""
        key = _worker_key(url)
        return next((e.url for e in self._peers.endpoints() if _worker_key(e.url) == key), None)

    def check_decode_plan(self, request: GenerateRequest) -> None:
        source = request.plan.prefill
        if source is None:
            raise HandoffRefused("a decode plan needs a prefill source", 400)
        if self.known_peer(source.url) is None:
            raise HandoffRefused(f"prefill worker {source.url!r} is not among this worker's peers")

    def check_prefill_plan(self, request: GenerateRequest) -> str:
        """The plan's decode worker as discovery names it; checked before the rank sees the request."""
        destination = request.plan.destination
        if destination is None:
            raise HandoffRefused("a prefill plan needs a destination", 400)
        url = self.known_peer(destination.url)
        if url is None:
            raise HandoffRefused(f"decode worker {destination.url!r} is not among this worker's peers")
        return url

    async def confirm_reservation(self, request: GenerateRequest, decode_url: str) -> Reservation:
        """The reservation a checked prefill plan names, as the decode worker at `decode_url` confirms it."""
        destination = request.plan.destination
        assert destination is not None
        query = ReservationQuery(destination.rank, request.request_id, destination.reservation_token)
        try:
            reservation = await self._confirm_at(decode_url, query)
        except WorkerUnavailable as error:
            raise HandoffRefused(f"decode worker {decode_url} did not confirm the reservation: {error}", 502) from error
        if reservation is None:
            raise HandoffRefused(f"decode worker {decode_url} refused the reservation (unknown request, wrong token, "
                                 "or already confirmed)")
        now = time.time()
        if not now < reservation.write_deadline_unix_s <= now + self._max_write_window_s:
            raise HandoffRefused(f"reservation write deadline {reservation.write_deadline_unix_s:.3f} is not within "
                                 f"{self._max_write_window_s:.0f} s from now ({now:.3f})")
        if not 0 < reservation.transfer_timeout_s <= MAX_TRANSFER_TIMEOUT_S:
            raise HandoffRefused(f"reservation transfer timeout {reservation.transfer_timeout_s} s is not in "
                                 f"(0, {MAX_TRANSFER_TIMEOUT_S:.0f}]")
        return reservation
