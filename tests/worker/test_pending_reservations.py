"""A rank actor's prefill plans and their reservations, which arrive as two actor calls in either order: the request
gets its reservation (or the refusal) whichever comes first, and no future stays behind once the request has ended."""

import asyncio
import time

import pytest

from pdserve.wire.protocol import Reservation
from pdserve.worker.pending_reservations import PendingReservations

WAIT_S = 2.0


def reservation() -> Reservation:
    return Reservation("decode-agent", b"meta", [3, 4], 0, time.time() + 60, 30.0)


@pytest.mark.parametrize("delivered_first", [False, True])
def test_a_reservation_reaches_its_request_in_either_order(delivered_first):
    async def scenario():
        pending = PendingReservations()
        confirmed = reservation()
        if delivered_first:
            pending.deliver("r1", confirmed)
        waiting = pending.claim("r1")
        if not delivered_first:
            pending.deliver("r1", confirmed)
        got = await asyncio.wait_for(waiting, WAIT_S)
        pending.drop("r1", waiting)  # the request ended
        return got, confirmed, len(pending)

    got, confirmed, left = asyncio.run(scenario())
    assert got is confirmed and left == 0


def test_a_refusal_in_either_order_cancels_the_requests_future():
    async def scenario():
        pending = PendingReservations()
        after = pending.claim("submitted-first")
        pending.deliver("submitted-first", None)
        pending.deliver("refused-first", None)
        before = pending.claim("refused-first")
        await asyncio.wait({after, before}, timeout=WAIT_S)
        return after.cancelled(), before.cancelled()

    assert asyncio.run(scenario()) == (True, True)


def test_a_reservation_no_request_claims_is_dropped_after_a_while():
    async def scenario():
        pending = PendingReservations(unclaimed_s=0.05)
        waiting = pending.claim("ended")
        pending.drop("ended", waiting)  # the request ended (aborted) before its reservation came
        pending.deliver("ended", reservation())
        pending.deliver("never-submitted", reservation())
        held = len(pending)
        deadline = time.monotonic() + WAIT_S
        while len(pending) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return held, len(pending)

    assert asyncio.run(scenario()) == (2, 0)

