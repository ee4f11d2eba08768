"""Every path of the prefill -> decode hand-off, between a prefill and a decode rank of this process (real engines,
the in-process transfer backend, the worker edge's guard): tokens equal colocated ones, each failure ends with a clear
error and frees every page (at once, or after the quarantine when a write could still land), the prefill computes while
its reservation is confirmed but writes only once it is, and nothing is written, nor any decode started, for a
reservation a caller forged."""

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import replace

import pytest
import tokenizers
import torch
from inprocess_pair import DECODE_URL, Pair, at_rest, collect, decode_plan
from probes import eventually

from pdserve.disagg.receiver import ReceiverState
from pdserve.disagg.sender import SenderState
from pdserve.engine.engine import NoCapacityError
from pdserve.wire.client import WorkerUnavailable
from pdserve.wire.protocol import GenerateRequest, KVDestination, Plan, Reservation, ReservationQuery
from pdserve.wire.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
PROMPT = list(range(2, 42))  # 40 tokens: 3 pages
HANDOFF_BOUND_S = 1.5 + 0.5  # the pair's prefill timeout + transfer timeout
QUARANTINE_S = HANDOFF_BOUND_S + 0.05 + 3.0  # + clock margin + slack for a loaded machine
_ids = itertools.count()


@pytest.fixture(scope="module")
def pair(tiny_v2):
    made = Pair(tiny_v2)
    yield made
    made.close()


@pytest.fixture
def fresh(pair):
    """The pair with no faults; every page back at rest on both sides afterwards."""
    pair.reset()
    yield pair
    pair.reset()
    assert eventually(lambda: at_rest(pair.prefill) and at_rest(pair.decode), timeout_s=QUARANTINE_S), \
        (pair.prefill.load(), pair.decode.load(), list(pair.decode.engine.requests))


def new_id(name: str) -> str:
    return f"{name}-{next(_ids)}"


def tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def wait_for_state(role, request_id: str, state, timeout_s: float = 10.0) -> None:
    assert eventually(lambda: role.state_of(request_id) is state, timeout_s=timeout_s, interval_s=0.002), \
        f"{request_id} never reached {state} (now {role.state_of(request_id)})"


def reception(pair, request_id: str):
    return pair.decode.receiver._receptions[request_id]


async def deliver(runtime, payload: bytes) -> None:
    runtime.receiver.on_notification("someone", payload)


class GatedReservations:
    """The decode rank's page reservations wait until `open()`, then reserve, or raise `error` (a stand-in for a
    step thread that is slow to take the reservation up, or a pool that stays full)."""

    def __init__(self, pair: Pair, monkeypatch, error: Exception | None = None):
        self._pair, self._gate = pair, asyncio.Event()
        port = pair.decode.receiver._pages
        reserve = port.reserve

        async def gated(request):
            await self._gate.wait()
            if error is not None:
                raise error
            return await reserve(request)

        monkeypatch.setattr(port, "reserve", gated)

    def open(self) -> None:
        self._pair.loop.call_soon_threadsafe(self._gate.set)


class GatedJoin:
    """The decode rank's join of a handed-off request into its batch waits until `open()` (a step loop slow to come
    around)."""

    def __init__(self, pair: Pair, monkeypatch):
        self._pair, self.gate = pair, asyncio.Event()
        port = pair.decode.receiver._pages
        start_decoding = port.start_decoding

        async def gated(request_id, first):
            await self.gate.wait()
            return await start_decoding(request_id, first)

        monkeypatch.setattr(port, "start_decoding", gated)

    def open(self) -> None:
        self._pair.loop.call_soon_threadsafe(self.gate.set)


class GatedConfirms:
    """The prefill worker edge's reservation confirms wait until `open()` (a slow round trip to the decode worker),
    then ask the decode worker; `refuse`: they answer as a decode worker that refuses (the decode rank never hears of
    it); `alter`: changes what the decode worker answered."""

    def __init__(self, pair: Pair, monkeypatch, refuse: bool = False,
                 alter: Callable[[Reservation], Reservation] | None = None):
        self._pair, self._gate = pair, asyncio.Event()
        guard = pair.prefill_worker.guard
        confirm_at = guard._confirm_at

        async def gated(url, query):
            await self._gate.wait()
            if refuse:
                return None
            reservation = await confirm_at(url, query)
            return reservation if alter is None or reservation is None else alter(reservation)

        monkeypatch.setattr(guard, "_confirm_at", gated)

    def open(self) -> None:
        self._pair.loop.call_soon_threadsafe(self._gate.set)


def written_bytes(pair: Pair) -> int:
    return pair.prefill.counters.kv_transfer_bytes


def test_handed_off_tokens_equal_colocated_ones_and_every_page_comes_back(fresh):
    colocated = fresh.generate(fresh.decode, GenerateRequest(new_id("both"), 0, PROMPT, GREEDY, Plan("both")))
    events = fresh.disaggregated(new_id("pd"), PROMPT, GREEDY)
    assert events[-1].finish_reason == "length", events[-1].error
    assert tokens(events) == tokens(colocated) and len(tokens(events)) == GREEDY.max_tokens


def test_a_first_token_inside_a_character_comes_out_once(fresh, tiny_v2):
    """The prefill rank's text for its one token must be what the decode rank's detokenizer gives for it (nothing yet,
    when the token ends inside a character), not the flush of a request that ends there: the decode rank releases
    those bytes with the next text, and the client got them twice (P/D text "\ufffd\ufffd inst..." where colocated
    had "\ufffd inst...")."""
    byte = tokenizers.Tokenizer.from_file(f"{tiny_v2}/tokenizer.json").token_to_id("\u00b8")  # the lone byte 0xB8
    sampling = replace(GREEDY, logit_bias={byte: 100.0})  # every token that byte
    colocated = fresh.generate(fresh.decode, GenerateRequest(new_id("both"), 0, PROMPT, sampling, Plan("both")))
    events = fresh.disaggregated(new_id("pd"), PROMPT, sampling)
    assert tokens(events) == tokens(colocated) == [byte] * GREEDY.max_tokens
    assert "".join(e.text for e in events) == "".join(e.text for e in colocated) == "\ufffd" * GREEDY.max_tokens


def test_concurrent_hand_offs_each_get_their_own_kv(fresh):
    prompts = [[t + 50 * i for t in PROMPT] for i in range(4)]
    colocated = [tokens(fresh.generate(fresh.decode, GenerateRequest(new_id("c"), 0, p, GREEDY))) for p in prompts]

    async def all_at_once():
        return await asyncio.gather(*(collect(fresh.decode, decode_plan(new_id("many"), p, GREEDY)) for p in prompts))

    assert [tokens(events) for events in fresh.run(all_at_once())] == colocated


def test_each_write_is_counted_with_its_bytes_and_time(fresh):
    counters = fresh.prefill.counters
    before_bytes, before_writes = counters.kv_transfer_bytes, len(counters.kv_transfer_seconds)
    fresh.disaggregated(new_id("count"), PROMPT, GREEDY)
    layout = fresh.prefill.backend.layout
    assert counters.kv_transfer_bytes - before_bytes == 3 * layout.num_layers * layout.page_bytes
    assert len(counters.kv_transfer_seconds) == before_writes + 1 and counters.kv_transfer_seconds[-1] > 0


def test_the_prefill_is_asked_for_while_the_pages_are_reserved_and_gets_them_once_they_are(fresh, monkeypatch):
    colocated = fresh.generate(fresh.decode, GenerateRequest(new_id("both"), 0, PROMPT, GREEDY, Plan("both")))
    gate = GatedReservations(fresh, monkeypatch)
    rid = new_id("overlap")
    running = fresh.start_disaggregated(rid, PROMPT, GREEDY)
    wait_for_state(fresh.decode.receiver, rid, ReceiverState.CONFIRMED)  # the prefill worker asked; its answer waits
    time.sleep(0.05)
    assert not reception(fresh, rid).pages.done()
    assert fresh.prefill.sender.state_of(rid) in (SenderState.COMPUTING, SenderState.COMPUTED)  # computing meanwhile
    assert not fresh.prefill.sender.confirmed(rid)  # but it writes nothing before the answer
    gate.open()
    assert tokens(running.result(10)) == tokens(colocated)


def test_a_reservation_that_fails_while_the_prefill_is_asked_for_ends_with_its_error(fresh, monkeypatch):
    gate = GatedReservations(fresh, monkeypatch, NoCapacityError("no room for the prompt's KV pages (test)"))
    written = written_bytes(fresh)
    rid = new_id("no-room")
    running = fresh.start_disaggregated(rid, PROMPT, GREEDY)
    wait_for_state(fresh.decode.receiver, rid, ReceiverState.CONFIRMED)
    gate.open()
    events = running.result(10)
    assert events[-1].finish_reason == "error" and "no room for the prompt's KV pages" in events[-1].error
    assert written_bytes(fresh) == written  # the prefill computed, but never wrote (the fixture: its pages came back)


def test_an_abort_while_the_pages_are_reserved_ends_the_reservation(fresh, monkeypatch):
    GatedReservations(fresh, monkeypatch)  # never opened: only the abort ends it
    rid = new_id("abort-reserving")
    running = fresh.start_disaggregated(rid, PROMPT, GREEDY)
    wait_for_state(fresh.decode.receiver, rid, ReceiverState.CONFIRMED)
    pages = reception(fresh, rid).pages
    assert fresh.run(fresh.decode.abort(rid))
    assert running.result(10)[-1].finish_reason == "abort"
    assert pages.cancelled() and fresh.decode.receiver.state_of(rid) is None  # no page ids went out: no quarantine


def test_the_prefill_computes_while_its_reservation_is_confirmed(fresh, monkeypatch):
    colocated = fresh.generate(fresh.decode, GenerateRequest(new_id("both"), 0, PROMPT, GREEDY, Plan("both")))
    confirms = GatedConfirms(fresh, monkeypatch)
    fresh.prefill.steps.test_step_delay_s = 0.5  # the confirm comes in while the prompt computes
    written = written_bytes(fresh)
    rid = new_id("computing")
    running = fresh.start_disaggregated(rid, PROMPT, GREEDY)
    wait_for_state(fresh.prefill.sender, rid, SenderState.COMPUTING)
    assert eventually(lambda: rid in fresh.prefill.engine.requests, timeout_s=5.0, interval_s=0.002)  # in the engine
    assert not fresh.prefill.sender.confirmed(rid)
    assert fresh.decode.receiver.state_of(rid) is ReceiverState.PREFILL_REQUESTED  # the confirm has not reached it
    confirms.open()
    assert eventually(lambda: fresh.prefill.sender.confirmed(rid), timeout_s=5.0, interval_s=0.002)
    assert fresh.prefill.sender.state_of(rid) is SenderState.COMPUTING
    events = running.result(10)
    assert tokens(events) == tokens(colocated) and events[-1].finish_reason == "length"
    assert written_bytes(fresh) > written


def test_a_confirm_that_comes_after_the_prefill_finished_is_written_then(fresh, monkeypatch):
    colocated = fresh.generate(fresh.decode, GenerateRequest(new_id("both"), 0, PROMPT, GREEDY, Plan("both")))
    confirms = GatedConfirms(fresh, monkeypatch)
    written = written_bytes(fresh)
    rid = new_id("computed")
    running = fresh.start_disaggregated(rid, PROMPT, GREEDY)
    wait_for_state(fresh.prefill.sender, rid, SenderState.COMPUTED)  # first token sampled, pages kept
    time.sleep(0.05)
    assert written_bytes(fresh) == written and fresh.prefill.sender.state_of(rid) is SenderState.COMPUTED
    assert not running.done()
    confirms.open()
    events = running.result(10)
    assert tokens(events) == tokens(colocated) and events[-1].finish_reason == "length"
    layout = fresh.prefill.backend.layout
    assert written_bytes(fresh) - written == 3 * layout.num_layers * layout.page_bytes


@pytest.mark.parametrize("state", [SenderState.COMPUTING, SenderState.COMPUTED])
def test_a_refused_confirm_ends_the_prefill_writes_nothing_and_frees_its_pages(fresh, monkeypatch, state):
    confirms = GatedConfirms(fresh, monkeypatch, refuse=True)
    if state is SenderState.COMPUTING:
        fresh.prefill.steps.test_step_delay_s = 0.5
    written = written_bytes(fresh)
    rid = new_id(f"refused-{state.value}")
    running = fresh.start_disaggregated(rid, PROMPT, GREEDY)
    wait_for_state(fresh.prefill.sender, rid, state)
    pool_before = fresh.decode.engine.runner.kv_cache.clone()
    confirms.open()
    events = running.result(10)
    assert events[-1].finish_reason == "error" and "refused the reservation" in events[-1].error
    assert fresh.prefill.sender.state_of(rid) is None
    assert eventually(lambda: at_rest(fresh.prefill), timeout_s=5.0)
    assert written_bytes(fresh) == written
    assert torch.equal(fresh.decode.engine.runner.kv_cache, pool_before)
    assert fresh.decode.receiver.state_of(rid) is None  # never confirmed there: its pages freed at once


def test_a_confirmed_reservation_that_does_not_fit_the_prompt_ends_the_prefill(fresh, monkeypatch):
    confirms = GatedConfirms(fresh, monkeypatch, alter=lambda confirmed: replace(confirmed,
                                                                                 page_ids=confirmed.page_ids[:-1]))
    confirms.open()
    written = written_bytes(fresh)
    events = fresh.disaggregated(new_id("misfit"), PROMPT, GREEDY)
    assert events[-1].finish_reason == "error" and "does not fit" in events[-1].error
    assert eventually(lambda: at_rest(fresh.prefill), timeout_s=5.0)
    assert written_bytes(fresh) == written


def test_the_first_token_goes_out_before_the_request_joins_the_decode_batch(fresh, monkeypatch):
    colocated = fresh.generate(fresh.decode, GenerateRequest(new_id("both"), 0, PROMPT, GREEDY, Plan("both")))
    join = GatedJoin(fresh, monkeypatch)
    rid = new_id("announced")

    async def first_then_the_rest():
        stream = fresh.decode.generate(decode_plan(rid, PROMPT, GREEDY))
        first = await asyncio.wait_for(anext(stream), 10)
        state = fresh.decode.receiver.state_of(rid)
        join.gate.set()
        return first, state, [event async for event in stream]

    first, state, rest = fresh.run(first_then_the_rest())
    assert state is ReceiverState.KV_ARRIVED  # the join still waited at the gate
    assert first.finish_reason is None and first.prompt_tokens == len(PROMPT)
    assert tokens([first, *rest]) == tokens(colocated) and rest[-1].finish_reason == "length"


def test_tokens_made_while_the_first_is_on_its_way_follow_it_in_order(fresh, monkeypatch):
    """The request may join the batch and step before its announced first token has gone out: what those steps make
    waits behind the first token (RankRuntime.serve hands events on directly, not through a queue)."""
    colocated = fresh.generate(fresh.decode, GenerateRequest(new_id("both"), 0, PROMPT, GREEDY, Plan("both")))
    rid = new_id("stepped-early")
    admit = fresh.decode._admit

    async def admitted_late(request, reservation):
        first = await admit(request, reservation)
        made = fresh.decode.engine.requests.get(rid)
        deadline = time.monotonic() + 10
        while (made is None or len(made.output_token_ids) < 3) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
            made = fresh.decode.engine.requests.get(rid) or made
        assert made is not None and len(made.output_token_ids) >= 3  # steps ran before the first event went out
        return first

    monkeypatch.setattr(fresh.decode, "_admit", admitted_late)
    events = fresh.run(collect(fresh.decode, decode_plan(rid, PROMPT, GREEDY)))
    assert tokens(events) == tokens(colocated) and events[-1].finish_reason == "length"


def test_a_first_token_that_ends_the_request_waits_for_the_decode_engine(fresh, monkeypatch):
    """Its end (here max_tokens 1, or one of the stop token ids) is the engine's to say: no announcement."""
    colocated = fresh.generate(fresh.decode, GenerateRequest(new_id("both"), 0, PROMPT, GREEDY, Plan("both")))
    first_token = colocated[0].token_ids[0]
    join = GatedJoin(fresh, monkeypatch)
    ends = {"length": replace(GREEDY, max_tokens=1), "stop": replace(GREEDY, stop_token_ids=[first_token])}
    running = {end: fresh.start_disaggregated(new_id(end), PROMPT, sampling) for end, sampling in ends.items()}
    time.sleep(0.3)
    assert not any(events.done() for events in running.values())
    join.open()
    for end, events in running.items():
        got = events.result(10)
        assert tokens(got) == [first_token] and got[-1].finish_reason == end


def test_an_abort_after_the_first_token_while_it_joins_ends_with_abort(fresh, monkeypatch):
    GatedJoin(fresh, monkeypatch)  # never opened: the abort ends the join
    rid = new_id("abort-joining")

    async def abort_after_the_first():
        stream = fresh.decode.generate(decode_plan(rid, PROMPT, LONG))
        first = await asyncio.wait_for(anext(stream), 10)
        aborted = await fresh.decode.abort(rid)
        return first, aborted, await asyncio.wait_for(collect_rest(stream), 10)

    first, aborted, rest = fresh.run(abort_after_the_first())
    assert first.token_ids and aborted and [e.finish_reason for e in rest] == ["abort"]


def test_a_caller_gone_after_the_first_token_leaves_no_request_behind(fresh, monkeypatch):
    join = GatedJoin(fresh, monkeypatch)
    rid = new_id("gone-joining")

    async def leave_after_the_first():
        stream = fresh.decode.generate(decode_plan(rid, PROMPT, LONG))
        first = await asyncio.wait_for(anext(stream), 10)
        await stream.aclose()
        join.gate.set()  # a join already under way would run now: it is undone
        return first

    assert fresh.run(leave_after_the_first()).token_ids
    assert eventually(lambda: at_rest(fresh.decode), timeout_s=5.0), list(fresh.decode.engine.requests)


async def collect_rest(stream) -> list:
    return [event async for event in stream]


def test_a_reservation_is_confirmed_once_and_only_with_its_token(fresh):
    fresh.prefill_worker.mode = "hang"  # the reservation waits in PREFILL_REQUESTED
    rid = new_id("confirm")
    running = fresh.start_disaggregated(rid, PROMPT, GREEDY)
    wait_for_state(fresh.decode.receiver, rid, ReceiverState.PREFILL_REQUESTED)
    token = reception(fresh, rid).token
    refused_before = fresh.decode.counters.reservations_refused
    assert fresh.run(fresh.decode.confirm_reservation(ReservationQuery(0, rid, "forged"))) is None
    assert fresh.run(fresh.decode.confirm_reservation(ReservationQuery(0, "someone-else", token))) is None
    reservation = fresh.run(fresh.decode.confirm_reservation(ReservationQuery(0, rid, token)))
    assert reservation is not None and len(reservation.page_ids) == 3
    assert time.time() < reservation.write_deadline_unix_s <= time.time() + 1.5
    assert fresh.run(fresh.decode.confirm_reservation(ReservationQuery(0, rid, token))) is None  # once only
    assert fresh.decode.counters.reservations_refused - refused_before == 3
    assert fresh.run(fresh.decode.abort(rid))
    assert running.result(10)[-1].finish_reason == "abort"


@pytest.mark.parametrize("destination", [
    KVDestination("http://attacker.example:80", 0, "x"),  # not a peer: never called, the rank never sees it
    KVDestination(DECODE_URL, 0, "made-up-token"),  # a peer, but no reservation has that token
], ids=["unknown-worker", "made-up-token"])
def test_a_forged_prefill_plan_is_refused_and_writes_nothing(fresh, destination):
    victim = new_id("victim")
    fresh.prefill_worker.mode = "hang"
    running = fresh.start_disaggregated(victim, PROMPT, GREEDY)  # a real reservation the forger aims at
    wait_for_state(fresh.decode.receiver, victim, ReceiverState.PREFILL_REQUESTED)
    pool_before = fresh.decode.engine.runner.kv_cache.clone()
    written, steps = written_bytes(fresh), fresh.prefill.steps.snapshot.steps_completed
    forged = GenerateRequest(victim, 0, [7] * 40, GREEDY, Plan("prefill", destination=destination))
    fresh.prefill_worker.mode = "normal"  # the forger reaches the prefill worker's edge

    async def forge():
        return [event async for event in fresh.prefill_worker.generate(forged, 10)]

    with pytest.raises(WorkerUnavailable, match="HTTP 403"):
        fresh.run(forge())
    assert eventually(lambda: at_rest(fresh.prefill), timeout_s=5.0)  # what it may have computed is freed
    if destination.url != DECODE_URL:
        assert fresh.prefill.steps.snapshot.steps_completed == steps  # refused before the rank saw it
    time.sleep(0.1)
    assert written_bytes(fresh) == written
    assert torch.equal(fresh.decode.engine.runner.kv_cache, pool_before)
    assert fresh.decode.receiver.state_of(victim) is ReceiverState.PREFILL_REQUESTED  # the victim's is untouched
    fresh.run(fresh.decode.abort(victim))
    assert running.result(10)[-1].finish_reason == "abort"


def test_a_prefill_plan_with_no_reservation_coming_is_an_error(fresh):
    request = GenerateRequest(new_id("unconfirmed"), 0, PROMPT, GREEDY,
                              Plan("prefill", destination=KVDestination(DECODE_URL, 0, "token")))
    events = fresh.generate(fresh.prefill, request)  # straight to the rank, past the worker edge
    assert [e.finish_reason for e in events] == ["error"] and "needs a reservation" in events[0].error


def test_a_notification_before_the_confirm_is_rejected(fresh):
    fresh.prefill_worker.mode = "hang"
    rid = new_id("early")
    running = fresh.start_disaggregated(rid, PROMPT, GREEDY)
    wait_for_state(fresh.decode.receiver, rid, ReceiverState.PREFILL_REQUESTED)
    rejected = fresh.decode.counters.notifications_rejected
    fresh.run(deliver(fresh.decode, reception(fresh, rid).token.encode()))  # nobody may have written yet
    assert fresh.decode.counters.notifications_rejected == rejected + 1
    assert fresh.decode.receiver.state_of(rid) is ReceiverState.PREFILL_REQUESTED
    fresh.run(fresh.decode.abort(rid))
    running.result(10)


def test_a_replayed_or_unknown_notification_starts_no_decode(fresh, monkeypatch):
    seen: list[bytes] = []
    backend = fresh.decode.backend
    deliver_original = backend._on_notification
    monkeypatch.setattr(backend, "_on_notification", lambda w, p: (seen.append(p), deliver_original(w, p)))
    fresh.disaggregated(new_id("spent"), PROMPT, GREEDY)
    assert len(seen) == 1
    rejected = fresh.decode.counters.notifications_rejected
    for payload in (seen[0], b"no-such-token"):
        fresh.run(deliver(fresh.decode, payload))
    assert fresh.decode.counters.notifications_rejected == rejected + 2
    assert not fresh.decode.engine.requests
    assert eventually(lambda: fresh.decode.load().running == 0, timeout_s=10)  # the load snapshot follows a step


@pytest.mark.parametrize("side", ["prefill", "colocated"])
def test_a_fault_of_ours_starting_a_request_ends_its_stream_at_once(fresh, monkeypatch, side):
    """A request the rank fails to start for a reason it does not expect (a bug; once an llguidance too old for a
    list of EOS ids) ends with an error event at once: its stream stayed open, and a P/D request hung until the
    prefill timeout."""
    def broken(*args, **kwargs):
        raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")

    if side == "prefill":
        monkeypatch.setattr(fresh.prefill.engine, "add_prefill_only", broken)
        events = fresh.disaggregated(new_id("broken-prefill"), PROMPT, GREEDY)
        assert events[-1].prefill_failed  # the router tries another prefill rank, or the decode rank itself
    else:
        monkeypatch.setattr(fresh.decode.engine, "add_request", broken)
        events = fresh.generate(fresh.decode, GenerateRequest(new_id("broken"), 0, PROMPT, GREEDY, Plan("both")))
    assert events[-1].finish_reason == "error" and "TypeError" in events[-1].error, events[-1]
    assert not tokens(events)


def test_a_refused_prefill_frees_the_reservation_at_once(fresh):
    fresh.prefill_worker.mode = "refuse"
    rid = new_id("refused")
    events = fresh.disaggregated(rid, PROMPT, GREEDY)
    assert events[-1].finish_reason == "error" and "refused" in events[-1].error
    assert events[-1].prefill_failed  # the router may retry on this decode rank with another prefill rank
    assert fresh.decode.receiver.state_of(rid) is None  # never confirmed: nothing can land, no quarantine
    assert eventually(lambda: at_rest(fresh.decode), timeout_s=2.0)


def test_prefill_death_after_the_confirm_quarantines_the_reservation_then_frees_it(fresh):
    fresh.prefill_worker.mode = "die_after_confirm"
    rid = new_id("died")
    events = fresh.disaggregated(rid, PROMPT, GREEDY)
    assert events[-1].finish_reason == "error"
    assert fresh.decode.receiver.state_of(rid) is ReceiverState.QUARANTINED
    assert not at_rest(fresh.decode)  # a write could still land: the pages wait out the deadline (the fixture checks)


def test_decode_death_fails_the_write_and_frees_the_prefill_pages(fresh):
    rid = new_id("decode-died")
    fresh.prefill.steps.test_step_delay_s = 0.3  # time to lose the decode rank while the prefill computes
    failures = fresh.prefill.counters.kv_transfer_failures
    running = fresh.start_disaggregated(rid, PROMPT, GREEDY)
    wait_for_state(fresh.prefill.sender, rid, SenderState.COMPUTING)
    assert eventually(lambda: fresh.prefill.sender.confirmed(rid), timeout_s=5.0, interval_s=0.002)  # peer added
    fresh.fabric.leave(fresh.decode.backend.name)  # its pool is unreachable now
    try:
        events = running.result(15)
    finally:
        fresh.fabric.join(fresh.decode.backend)
    assert events[-1].finish_reason == "error" and "KV transfer failed" in events[-1].error
    assert fresh.prefill.counters.kv_transfer_failures == failures + 1
    assert eventually(lambda: at_rest(fresh.prefill), timeout_s=5.0)


@pytest.mark.parametrize("state", [ReceiverState.PREFILL_REQUESTED, ReceiverState.CONFIRMED, ReceiverState.DECODING])
def test_abort_during_each_receiver_state_ends_with_abort(fresh, state):
    rid = new_id(f"abort-{state.value}")
    if state is ReceiverState.PREFILL_REQUESTED:
        fresh.prefill_worker.mode = "hang"
    elif state is ReceiverState.CONFIRMED:
        fresh.prefill.steps.test_step_delay_s = 0.5  # the prefill computes while the reservation is confirmed
    running = fresh.start_disaggregated(rid, PROMPT, LONG)
    if state is ReceiverState.DECODING:
        assert eventually(lambda: fresh.decode.load().running == 1, timeout_s=10, interval_s=0.002)
    else:
        wait_for_state(fresh.decode.receiver, rid, state)
    assert fresh.run(fresh.decode.abort(rid))
    assert running.result(10)[-1].finish_reason == "abort"


@pytest.mark.parametrize("state", [SenderState.COMPUTING, SenderState.COMPUTED, SenderState.WRITING])
def test_abort_during_each_sender_state_frees_the_prefill_pages(fresh, monkeypatch, state):
    rid = new_id(f"abort-{state.value}")
    confirms = GatedConfirms(fresh, monkeypatch)
    if state is SenderState.COMPUTING:
        fresh.prefill.steps.test_step_delay_s = 0.5
    elif state is SenderState.WRITING:
        fresh.prefill_faults.write_delay_s = 0.4
    if state is not SenderState.COMPUTED:  # COMPUTED: the prompt is computed, its reservation not confirmed yet
        confirms.open()
    running = fresh.start_disaggregated(rid, PROMPT, GREEDY)
    wait_for_state(fresh.prefill.sender, rid, state)
    assert fresh.run(fresh.prefill.abort(rid))  # as the decode rank does when it gives up
    confirms.open()
    assert running.result(15)[-1].finish_reason == "error"  # the decode rank hears the prefill ended without KV
    assert eventually(lambda: at_rest(fresh.prefill), timeout_s=5.0)


def test_a_prefill_that_finishes_after_the_write_deadline_never_writes(fresh):
    rid = new_id("late")
    fresh.prefill.steps.test_step_delay_s = HANDOFF_BOUND_S + 0.5  # the decode rank gives up before the prefill is done
    fresh.prefill_worker.drop_aborts = True  # and its abort is lost: only the deadline stops the write
    counters = fresh.prefill.counters
    written, failures = counters.kv_transfer_bytes, counters.kv_transfer_failures
    running = fresh.start_disaggregated(rid, PROMPT, GREEDY)
    wait_for_state(fresh.decode.receiver, rid, ReceiverState.CONFIRMED)
    assert eventually(lambda: reception(fresh, rid).pages.done(), timeout_s=5.0)
    pages = list(reception(fresh, rid).pages.result())
    reserved_before = fresh.decode.engine.runner.kv_cache[:, pages].clone()
    assert running.result(15)[-1].finish_reason == "error"
    assert eventually(lambda: counters.kv_transfer_failures == failures + 1, timeout_s=10)
    assert counters.kv_transfer_bytes == written  # the WRITE was never posted
    assert torch.equal(fresh.decode.engine.runner.kv_cache[:, pages], reserved_before)


@pytest.mark.parametrize("fault", ["timeout", "error", "lost notification"])
def test_a_failed_write_ends_with_an_error_and_holds_the_reservation_until_it_cannot_land(fresh, fault):
    if fault == "timeout":
        fresh.prefill_faults.write_delay_s = 1.0  # past the transfer timeout (0.5 s)
    elif fault == "error":
        fresh.prefill_faults.write_error = "link down"
    else:
        fresh.prefill_faults.drop_notifications = True
    rid = new_id(fault.replace(" ", "-"))
    events = fresh.disaggregated(rid, PROMPT, GREEDY)
    assert events[-1].finish_reason == "error" and not tokens(events)
    assert fresh.decode.receiver.state_of(rid) in (ReceiverState.QUARANTINED, None)


def test_a_hand_off_that_never_answers_is_bounded_by_the_timeouts(fresh):
    fresh.prefill_worker.mode = "hang"
    started = time.monotonic()
    events = fresh.disaggregated(new_id("bounded"), PROMPT, GREEDY)
    assert events[-1].finish_reason == "error" and "did not come" in events[-1].error
    assert time.monotonic() - started < HANDOFF_BOUND_S + 5.0


def test_a_reservation_waits_for_room_in_a_full_pool_instead_of_failing(fresh):
    """The decode rank's pool is nearly full with a running request: a hand-off that needs more pages than are free
    waits for them (up to the prefill timeout) and then runs, as a request waits in the engine's queue."""
    page_size = fresh.decode.engine.cfg.page_size
    hog = GenerateRequest(new_id("hog"), 0, [2 + i % 400 for i in range(50 * page_size)],
                          SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), Plan("both"))
    # The hog holds its 53 of 64 pages for 20 steps of >= 10 ms: long enough to see the reservation wait, and short
    # of the pair's 1.5 s prefill timeout on a loaded CI machine (40 steps once took longer there)
    fresh.decode.steps.test_step_delay_s = 0.01
    hogging = asyncio.run_coroutine_threadsafe(collect(fresh.decode, hog), fresh.loop)
    assert eventually(lambda: fresh.decode.load().free_pages < 20, timeout_s=10.0)
    rid = new_id("pd")
    waiting = fresh.start_disaggregated(rid, [2 + i % 400 for i in range(20 * page_size)], GREEDY)
    assert eventually(lambda: fresh.decode.load().waiting == 1 or waiting.done(), timeout_s=10.0, interval_s=0.002)
    assert not waiting.done(), "the reservation should have waited for the hog's pages"  # and was counted as queued
    assert fresh.decode.receiver.state_of(rid) is ReceiverState.RESERVING  # no prefill asked for while it waits
    events = waiting.result(30)
    assert events[-1].finish_reason == "length", events[-1].error
    assert len(tokens(events)) == GREEDY.max_tokens
    assert hogging.result(30)[-1].finish_reason == "length"


def test_reservations_waiting_for_room_get_it_in_arrival_order(fresh, monkeypatch):
    """A long prompt waiting for pages is not passed by a short one that would fit the pages free now: reservations
    wait in line, or a stream of short prompts could keep a long one out of a busy decode rank for good."""
    page_size = fresh.decode.engine.cfg.page_size
    reserved: list[str] = []
    reserve = fresh.decode.engine.reserve

    def noting(request_id, *args):
        pages = reserve(request_id, *args)
        reserved.append(request_id)
        return pages

    monkeypatch.setattr(fresh.decode.engine, "reserve", noting)
    hog = GenerateRequest(new_id("hog"), 0, [2 + i % 400 for i in range(50 * page_size)],
                          SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), Plan("both"))
    # The hog holds its 53 of 64 pages for 20 steps of >= 10 ms: long enough to see the reservation wait, and short
    # of the pair's 1.5 s prefill timeout on a loaded CI machine (40 steps once took longer there)
    fresh.decode.steps.test_step_delay_s = 0.01
    hogging = asyncio.run_coroutine_threadsafe(collect(fresh.decode, hog), fresh.loop)
    assert eventually(lambda: fresh.decode.load().free_pages < 20, timeout_s=10.0)
    long_id, short_id = new_id("long"), new_id("short")
    long_one = fresh.start_disaggregated(long_id, [2 + i % 400 for i in range(20 * page_size)], GREEDY)
    assert eventually(lambda: fresh.decode.load().waiting == 1, timeout_s=10.0, interval_s=0.002)
    short_one = fresh.start_disaggregated(short_id, PROMPT, GREEDY)  # 3 pages: free now, but behind the long one
    assert eventually(lambda: fresh.decode.load().waiting == 2, timeout_s=10.0, interval_s=0.002)
    assert fresh.decode.load().free_pages >= 3 and fresh.decode.receiver.state_of(short_id) is ReceiverState.RESERVING
    for done in (long_one, short_one):
        assert done.result(30)[-1].finish_reason == "length"
    assert reserved == [long_id, short_id]
    assert hogging.result(30)[-1].finish_reason == "length"
    assert eventually(lambda: at_rest(fresh.decode), timeout_s=10.0)
