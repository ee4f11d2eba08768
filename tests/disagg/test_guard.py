"""The worker edge's checks on hand-off plans: peers only from discovery (however a URL is spelled, checked before the
rank sees anything), a prefill plan's reservation as the decode worker confirms it, and that reservation's deadline set
and bounded. The decode worker here is a stand-in answering what a compromised or broken one could."""

import asyncio
import time

import pytest

from pdserve.discovery.endpoints import StaticDiscovery
from pdserve.disagg.guard import MAX_WRITE_WINDOW_S, HandoffGuard, HandoffRefused
from pdserve.wire.client import WorkerUnavailable
from pdserve.wire.protocol import GenerateRequest, KVDestination, Plan, PrefillSource, Reservation, ReservationQuery

DECODE, PREFILL = "http://10.0.0.7:8100", "http://10.0.0.8:8100"


def reservation(deadline_in_s: float = 60.0, transfer_timeout_s: float = 30.0) -> Reservation:
    return Reservation("decode-agent", b"meta", [3, 4], 0, time.time() + deadline_in_s, transfer_timeout_s)


class DecodeWorker:
    """Answers reservation queries with `answer` (or raises it), recording what it was asked."""

    def __init__(self, answer):
        self.answer, self.asked = answer, []

    async def __call__(self, url: str, query: ReservationQuery):
        self.asked.append((url, query))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def prefill_plan(url: str = DECODE, token: str = "tok") -> GenerateRequest:
    return GenerateRequest("r1", 0, [1, 2, 3], plan=Plan("prefill", destination=KVDestination(url, 0, token)))


def confirm(guard: HandoffGuard, request: GenerateRequest):
    """What the edge does with a prefill plan: the destination checked at once, then the reservation confirmed."""
    return asyncio.run(guard.confirm_reservation(request, guard.check_prefill_plan(request)))


@pytest.mark.parametrize("spelling", [DECODE, DECODE + "/", "HTTP://10.0.0.7:8100", "http://10.0.0.7:8100/x/.."])
def test_a_peer_is_known_however_its_url_is_spelled(spelling):
    decode = DecodeWorker(reservation())
    guard = HandoffGuard(StaticDiscovery([DECODE]), decode)
    assert confirm(guard, prefill_plan(spelling)).page_ids == [3, 4]
    assert decode.asked == [(DECODE, ReservationQuery(0, "r1", "tok"))]  # the discovered URL, not the request's


@pytest.mark.parametrize("url", ["http://10.0.0.7:8101", "http://10.0.0.9:8100", "https://10.0.0.7:8100",
                                 "http://169.254.169.254/latest", "http://10.0.0.7:notaport", ""])
def test_a_destination_discovery_does_not_name_is_refused_at_once_without_a_call(url):
    decode = DecodeWorker(reservation())
    with pytest.raises(HandoffRefused) as refused:
        HandoffGuard(StaticDiscovery([DECODE]), decode).check_prefill_plan(prefill_plan(url))  # synchronous
    assert refused.value.status == 403 and decode.asked == []


@pytest.mark.parametrize("make_answer, status", [  # made when the test runs: deadlines are relative to now
    (lambda: None, 403),  # the decode worker refused: unknown request, wrong token, asked twice
    (lambda: reservation(deadline_in_s=-1.0), 403),  # already past
    (lambda: reservation(deadline_in_s=MAX_WRITE_WINDOW_S + 60), 403),  # too far ahead
    (lambda: reservation(transfer_timeout_s=0.0), 403),
    (lambda: reservation(transfer_timeout_s=10_000.0), 403),
    (lambda: WorkerUnavailable("connection refused", refused=True), 502),
])
def test_a_reservation_that_is_refused_or_out_of_bounds_is_refused(make_answer, status):
    with pytest.raises(HandoffRefused) as refused:
        confirm(HandoffGuard(StaticDiscovery([DECODE]), DecodeWorker(make_answer())), prefill_plan())
    assert refused.value.status == status


def test_a_prefill_plan_without_a_destination_is_a_bad_request():
    request = GenerateRequest("r1", 0, [1], plan=Plan("prefill"))
    with pytest.raises(HandoffRefused) as refused:
        HandoffGuard(StaticDiscovery([DECODE]), DecodeWorker(reservation())).check_prefill_plan(request)
    assert refused.value.status == 400


def test_a_decode_plan_must_name_a_discovered_prefill_worker():
    guard = HandoffGuard(StaticDiscovery([PREFILL]), DecodeWorker(None))
    guard.check_decode_plan(GenerateRequest("r", 0, [1], plan=Plan("decode", prefill=PrefillSource(PREFILL + "/", 0))))
    with pytest.raises(HandoffRefused) as refused:
        guard.check_decode_plan(GenerateRequest("r", 0, [1], plan=Plan("decode",
                                                                       prefill=PrefillSource(DECODE, 0))))
    assert refused.value.status == 403
    with pytest.raises(HandoffRefused) as refused:
        guard.check_decode_plan(GenerateRequest("r", 0, [1], plan=Plan("decode")))
    assert refused.value.status == 400


def test_closing_the_guard_releases_what_confirms_reservations():
    closed = []

    async def close() -> None:
        closed.append(True)

    asyncio.run(HandoffGuard(StaticDiscovery([DECODE]), DecodeWorker(None), close=close).close())
    asyncio.run(HandoffGuard(StaticDiscovery([DECODE]), DecodeWorker(None)).close())  # nothing to release
    assert closed == [True]
