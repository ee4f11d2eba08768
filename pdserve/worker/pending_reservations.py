"""The reservations a rank actor's prefill plans wait for, by request id. The worker edge submits a plan's request at
once and sends its reservation once confirmed, as a second actor call; Ray does not promise that an async actor runs
one caller's calls in order, so whichever comes first makes the request's future. The request's end drops it; one no
request claims (its request had already ended, or never came) is dropped after a while, so nothing stays behind."""

import asyncio

from pdserve.wire.protocol import Reservation

UNCLAIMED_S = 60.0  # well past any Ray delay between a request's submit and its reservation's delivery


class PendingReservations:
    def __init__(self, unclaimed_s: float = UNCLAIMED_S):
        self._futures: dict[str, asyncio.Future[Reservation]] = {}
        self._unclaimed_s = unclaimed_s

    def __len__(self) -> int:
        return len(self._futures)

    def claim(self, request_id: str) -> asyncio.Future[Reservation]:
        """The future a submitted prefill plan waits on; `drop` it when the request ends."""
        return self._future(request_id)

    def deliver(self, request_id: str, reservation: Reservation | None) -> None:
        """The edge's confirmed reservation; None: refused (the future is cancelled: the request ends)."""
        if request_id not in self._futures:  # its request has not come yet, or has already ended
            unclaimed = self._future(request_id)
            asyncio.get_running_loop().call_later(self._unclaimed_s, self.drop, request_id, unclaimed)
        future = self._futures[request_id]
        if future.done():
            return
        if reservation is None:
            future.cancel()
        else:
            future.set_result(reservation)

    def drop(self, request_id: str, future: asyncio.Future[Reservation]) -> None:
        if self._futures.get(request_id) is future:
            del self._futures[request_id]

    def _future(self, request_id: str) -> asyncio.Future[Reservation]:
        future = self._futures.get(request_id)
        if future is None:
            future = self._futures[request_id] = asyncio.get_running_loop().create_future()
        return future
