"""The worker edge's start of a prefill plan: the rank's stream starts before the reservation is confirmed, the edge's
answer waits for the confirm, a refused confirm ends in the guard's status with the rank's stream closed (which aborts
its prefill), and what the rank sent before the confirm came still reaches the caller after it. The rank and the
decode worker are stand-ins (the real pair: tests/disagg/test_handoff.py)."""

import asyncio
import time

import pytest

from pdserve.disagg.guard import HandoffGuard, HandoffRefused
from pdserve.discovery.endpoints import StaticDiscovery
from pdserve.wire.client import WorkerUnavailable
from pdserve.wire.protocol import GenerateRequest, KVDestination, Plan, Reservation, ReservationQuery
from pdserve.worker.prefill_start import start_prefill

DECODE = "http://10.0.0.7:8100"
WAIT_S = 2.0


def reservation() -> Reservation:
    return Reservation("decode-agent", b"meta", [3], 0, time.time() + 60, 30.0)


def prefill_plan(url: str = DECODE) -> GenerateRequest:
    return GenerateRequest("r1", 0, [1, 2, 3], plan=Plan("prefill", destination=KVDestination(url, 0, "tok")))


class DecodeWorker:
    """Answers a reservation query once the test sets `answer` (a reservation, None to refuse, or an error)."""

    def __init__(self) -> None:
        self.answer: asyncio.Future = asyncio.get_running_loop().create_future()

    async def __call__(self, url: str, query: ReservationQuery) -> Reservation | None:
        answer = await self.answer
        if isinstance(answer, Exception):
            raise answer
        return answer


class Rank:
    """A rank's stream of a request: yields `items` at once, then waits; records its start, its reservation and its
    closing."""

    def __init__(self, items: list[str]) -> None:
        self.items, self.reservation = items, None
        self.started, self.closed = asyncio.Event(), False

    async def generate(self, request: GenerateRequest, reservation):
        self.started.set()
        self.reservation = reservation
        try:
            for item in self.items:
                yield item
            await asyncio.Event().wait()  # the rest would follow the write
        finally:
            self.closed = True


async def started_before_the_confirm(answer, items: list[str]):
    """start_prefill under way, the rank started and the confirm still waiting; then `answer` comes."""
    decode, rank = DecodeWorker(), Rank(items)
    starting = asyncio.ensure_future(start_prefill(HandoffGuard(StaticDiscovery([DECODE]), decode), prefill_plan(),
                                                   rank.generate))
    await asyncio.wait_for(rank.started.wait(), WAIT_S)
    await asyncio.sleep(0.01)
    waited = not starting.done()
    decode.answer.set_result(answer)
    await asyncio.wait({starting}, timeout=WAIT_S)
    return starting, rank, waited


def test_the_rank_starts_before_the_confirm_and_what_it_sent_first_still_arrives():
    confirmed = reservation()

    async def scenario():
        starting, rank, waited = await started_before_the_confirm(confirmed, ["first"])
        stream = starting.result()
        first = await asyncio.wait_for(anext(stream), WAIT_S)
        given = await asyncio.wait_for(rank.reservation, WAIT_S)
        await stream.aclose()
        return waited, first, given, rank.closed

    waited, first, given, closed = asyncio.run(scenario())
    assert waited  # the edge's answer waited for the confirm while the rank ran
    assert first == "first" and given is confirmed
    assert closed  # the caller's leaving closes the rank's stream


@pytest.mark.parametrize("answer, status", [
    (None, 403),  # the decode worker refused
    (WorkerUnavailable("connection refused", refused=True), 502),
])
def test_a_refused_confirm_answers_with_its_status_and_closes_the_ranks_stream(answer, status):
    async def scenario():
        starting, rank, waited = await started_before_the_confirm(answer, [])
        return starting.exception(), rank.closed, waited

    error, closed, waited = asyncio.run(scenario())
    assert isinstance(error, HandoffRefused) and error.status == status
    assert waited and closed


def test_an_unknown_destination_is_refused_before_the_rank_sees_the_request():
    async def scenario():
        decode, rank = DecodeWorker(), Rank([])
        with pytest.raises(HandoffRefused) as refused:
            await start_prefill(HandoffGuard(StaticDiscovery([DECODE]), decode),
                                prefill_plan("http://attacker.example:80"), rank.generate)
        return refused.value.status, rank.started.is_set()

    assert asyncio.run(scenario()) == (403, False)
