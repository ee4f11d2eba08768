"""The decode side of the hand-off: reserve pages for a prompt, have a prefill worker fill them, decode on from its
first token. One `Reception` per request, in one `ReceiverState` at a time:

  RESERVING          an unguessable reservation token made; pages being reserved in the engine (`pages`)
  PREFILL_REQUESTED  the prefill worker was called with (this worker, rank, token): at once when the engine has room
                     for the prompt (its request travels and the prefill worker confirms while the pages are reserved),
                     else once the pages are reserved
  CONFIRMED          the prefill worker asked for the reservation with the token (once: a second query is refused)
                     and, once the pages were reserved, got their ids and the write deadline
  FIRST_TOKEN        the prefill's first token came; the KV notification has not yet
  KV_ARRIVED         the notification carrying the token came: every reserved page holds the prompt's KV
  DECODING           in the engine's running batch from the first token: the hand-off is over
  FAILED             given up while no write can land (no page ids handed out, or fully written): the pages are
                     freed (a reservation still under way is cancelled first)
  QUARANTINED        given up after page ids were handed out: a write may still land, so the pages stay out of use
                     until the write deadline plus the transfer timeout and a clock margin have passed; then FAILED

A notification is accepted only in CONFIRMED or FIRST_TOKEN and only with the token of that reservation, so no decode
starts on KV written for another request. Everything here runs on the rank's event loop; the engine is reached
through `DecodePages` (the step thread), the prefill worker through a `PrefillLink`.
"""

import asyncio
import enum
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.disagg.counters import HandoffCounters
from pdserve.wire.client import WorkerUnavailable
from pdserve.wire.protocol import GenerateRequest, KVDestination, Plan, PrefillSource, Reservation, ReservationQuery, TokenEvent

if TYPE_CHECKING:  # the backend module brings torch; the worker edge imports this module for CLOCK_MARGIN_S alone
    from pdserve.transfer.backend import TransferBackend

log = logging.getLogger(__name__)
CLOCK_MARGIN_S = 1.0  # allowed disagreement between host clocks for write deadlines


class ReceiverState(enum.Enum):
    RESERVING = "reserving"
    PREFILL_REQUESTED = "prefill_requested"
    CONFIRMED = "confirmed"
    FIRST_TOKEN = "first_token"
    KV_ARRIVED = "kv_arrived"
    DECODING = "decoding"
    FAILED = "failed"
    QUARANTINED = "quarantined"


AWAITING_KV = (ReceiverState.CONFIRMED, ReceiverState.FIRST_TOKEN)  # a write may be under way


class HandoffFailed(RuntimeError):
    """The prefill side did not deliver: an error answer, no answer in time, or no KV."""


class HandoffAborted(RuntimeError):
    """The request was aborted during its hand-off."""


class DecodePages(Protocol):
    """The engine, as the receiver needs it."""

    def has_room(self, request: GenerateRequest) -> bool:
        """Whether the engine's last published figures leave room for the prompt's pages now."""
        ...

    async def reserve(self, request: GenerateRequest) -> list[int]: ...

    async def free(self, request_id: str) -> None: ...

    def announces(self, request: GenerateRequest, first: TokenEvent) -> bool:
        """Whether the engine's event for the prefill's first token is known without it: the token ends nothing
        and no stop string or grammar, which only the engine sees, is asked for."""
        ...

    async def start_decoding(self, request_id: str, first: TokenEvent) -> TokenEvent: ...


class PrefillLink(Protocol):
    """A prefill worker as the decode rank calls it (`WorkerClient` over HTTP; a rank of this process in tests)."""

    def generate(self, request: GenerateRequest, first_token_timeout_s: float) -> AsyncIterator[TokenEvent]: ...

    async def abort(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class ReceiverConfig:
    rank: int
    worker_url: str  # how the prefill workers' discovery names this worker
    prefill_timeout_s: float  # bound on the prefill answering; sets the write deadline
    transfer_timeout_s: float  # bound on the KV arriving after that; the prefill rank cancels a write after it
    clock_margin_s: float = CLOCK_MARGIN_S


@dataclass(eq=False)
class Reception:
    request_id: str
    token: str
    kv_arrived: asyncio.Future
    pages: asyncio.Future[list[int]] | None = None  # the engine's reservation, under way or done
    write_deadline_unix_s: float = 0.0  # set when the prefill is requested
    handed_out: bool = False  # the page ids went to the prefill worker: a write may land
    state: ReceiverState = ReceiverState.RESERVING
    task: asyncio.Task | None = None  # the hand-off in progress


def _raise_if_not_reserved(reception: Reception) -> None:
    """What kept the pages from being reserved, over the prefill worker's refusal that followed from it."""
    pages = reception.pages
    if pages is not None and pages.done() and not pages.cancelled() and pages.exception() is not None:
        raise pages.exception()  # type: ignore[misc]


class Receiver:
    def __init__(self, cfg: ReceiverConfig, backend: "TransferBackend", pages: DecodePages,
                 prefill_link: Callable[[PrefillSource], PrefillLink], counters: HandoffCounters):
        self.cfg = cfg
        self._backend = backend
        self._pages = pages
        self._prefill_link = prefill_link
        self._counters = counters
        self._receptions: dict[str, Reception] = {}
        self._by_token: dict[str, Reception] = {}
        self._awaiting_kv = 0
        self._background: set[asyncio.Task] = set()

    def holds(self, request_id: str) -> bool:
        """Whether the request's pages are the receiver's to free (a hand-off in progress or quarantined)."""
        return request_id in self._receptions

    def state_of(self, request_id: str) -> ReceiverState | None:
        reception = self._receptions.get(request_id)
        return reception.state if reception else None

    async def receive(self, request: GenerateRequest,
                      announce: Callable[[TokenEvent], None] | None = None) -> TokenEvent:
        """Run the hand-off of a decode-plan request; returns its first event (the prefill's first token, now in the
        running batch). Raises HandoffFailed, HandoffAborted, or what reserving pages raised. `announce`: given the
        first token's event once the KV is in and before the request joins the batch, where the engine's event is
        known without it (`DecodePages.announces`), so the client need not wait for a turn of the step loop."""
        reception = Reception(request.request_id, secrets.token_urlsafe(32), asyncio.get_running_loop().create_future())
        self._receptions[reception.request_id] = reception
        self._by_token[reception.token] = reception
        reception.task = asyncio.ensure_future(self._hand_off(reception, request, announce))
        try:
            await asyncio.wait({reception.task})
        except asyncio.CancelledError:  # our caller went away
            reception.task.cancel()
            raise
        if reception.task.cancelled():
            raise HandoffAborted(f"request {request.request_id} was aborted during its KV hand-off")
        return reception.task.result()

    def abort(self, request_id: str) -> bool:
        """Stop a hand-off in progress (it then quarantines or frees its pages); False when there is none."""
        reception = self._receptions.get(request_id)
        if reception is None or reception.task is None or reception.task.done():
            return False
        reception.task.cancel()
        return True

    async def confirm(self, query: ReservationQuery) -> Reservation | None:
        """The reservation, to the prefill worker that presents its token while the prefill is requested, once its
        pages are reserved; else None (also when the reservation failed or the hand-off ended meanwhile)."""
        reception = self._receptions.get(query.request_id)
        if (reception is None or not hmac.compare_digest(reception.token.encode(), query.reservation_token.encode())
                or reception.state is not ReceiverState.PREFILL_REQUESTED):
            self._counters.reservations_refused += 1
            log.warning("refused a reservation query for %r (%s)", query.request_id,
                        reception.state.value if reception else "no such reservation")
            return None
        self._set(reception, ReceiverState.CONFIRMED)  # from here a second query is refused
        assert reception.pages is not None
        await asyncio.wait({reception.pages})  # no exception of the reservation's: the hand-off reports it
        if (reception.state is not ReceiverState.CONFIRMED or reception.pages.cancelled()
                or reception.pages.exception() is not None):
            return None
        reception.handed_out = True
        return Reservation(self._backend.name, self._backend.metadata(), list(reception.pages.result()), 0,
                           reception.write_deadline_unix_s, self.cfg.transfer_timeout_s)

    def on_notification(self, writer: str, payload: bytes) -> None:
        reception = self._by_token.get(payload.decode("utf-8", "replace"))
        if reception is None or reception.state not in AWAITING_KV:
            self._counters.notifications_rejected += 1
            log.warning("rejected a KV notification from %s (%s)", writer,
                        reception.state.value if reception else "no reservation has that token")
            return
        self._set(reception, ReceiverState.KV_ARRIVED)
        reception.kv_arrived.set_result(None)

    # --- one hand-off ------------------------------------------------------------------------------------------
    async def _hand_off(self, reception: Reception, request: GenerateRequest,
                        announce: Callable[[TokenEvent], None] | None) -> TokenEvent:
        assert request.plan.prefill is not None
        link = self._prefill_link(request.plan.prefill)
        bound_s = self.cfg.prefill_timeout_s + self.cfg.transfer_timeout_s
        room = self._pages.has_room(request)
        reception.pages = asyncio.ensure_future(self._pages.reserve(request))
        try:
            if not room:  # a queue for pages: the prefill is not started until they are there
                await asyncio.shield(reception.pages)
            first = await asyncio.wait_for(self._prefill_and_kv(reception, request, link), bound_s)
            if announce is not None and self._pages.announces(request, first):
                announce(replace(first, finish_reason=None))  # the prefill rank's own end (its one token) is not ours
            event = await self._pages.start_decoding(reception.request_id, first)
        except BaseException as error:
            self._give_up(reception, link, error)
            if isinstance(error, asyncio.TimeoutError):
                raise HandoffFailed(f"the prefill's first token and KV did not come within {bound_s:.3g} s "
                                    f"({reception.state.value})") from error
            raise
        self._set(reception, ReceiverState.DECODING)
        self._forget(reception)
        return event

    async def _prefill_and_kv(self, reception: Reception, request: GenerateRequest, link: PrefillLink) -> TokenEvent:
        source = request.plan.prefill
        assert source is not None
        destination = KVDestination(self.cfg.worker_url, self.cfg.rank, reception.token)
        prefill_request = GenerateRequest(request.request_id, source.rank, request.prompt_token_ids, request.sampling,
                                          Plan("prefill", destination=destination))
        reception.write_deadline_unix_s = time.time() + self.cfg.prefill_timeout_s
        self._set(reception, ReceiverState.PREFILL_REQUESTED)
        first: TokenEvent | None = None
        try:
            async for event in link.generate(prefill_request, self.cfg.prefill_timeout_s):
                first = event
                if event.finish_reason is not None:
                    break
        except WorkerUnavailable as error:
            _raise_if_not_reserved(reception)
            raise HandoffFailed(f"prefill worker {source.url}: {error}") from error
        _raise_if_not_reserved(reception)
        if first is None or first.finish_reason == "error" or not first.token_ids:
            raise HandoffFailed(f"prefill failed: {(first.error or first.finish_reason) if first else 'no answer'}")
        if reception.state is ReceiverState.PREFILL_REQUESTED:
            raise HandoffFailed("the prefill worker answered without confirming the reservation")
        if reception.state is ReceiverState.CONFIRMED:
            self._set(reception, ReceiverState.FIRST_TOKEN)
        await asyncio.shield(reception.kv_arrived)  # a cancelled wait must not cancel the future the notice sets
        return first

    def _give_up(self, reception: Reception, link: PrefillLink, error: BaseException) -> None:
        """Synchronous up to the state change, so no confirm or notification slips in between."""
        state = reception.state
        if state in (ReceiverState.PREFILL_REQUESTED, *AWAITING_KV):
            self._spawn(link.abort(reception.request_id))  # it may still be computing: stop it
        if reception.pages is not None:
            reception.pages.cancel()  # a reservation under way ends (the engine frees what it got, see free below)
        if state in AWAITING_KV and reception.handed_out:
            self._set(reception, ReceiverState.QUARANTINED)
            hold_s = reception.write_deadline_unix_s + self.cfg.transfer_timeout_s + self.cfg.clock_margin_s - time.time()
            log.info("request %s: hand-off failed after the confirm (%r); pages held %.1f s", reception.request_id,
                     error, hold_s)
            self._spawn(self._free_after(reception, hold_s))
        else:
            self._set(reception, ReceiverState.FAILED)
            self._forget(reception)
            self._spawn(self._pages.free(reception.request_id))

    async def _free_after(self, reception: Reception, delay_s: float) -> None:
        await asyncio.sleep(max(0.0, delay_s))
        self._set(reception, ReceiverState.FAILED)
        self._forget(reception)
        await self._pages.free(reception.request_id)

    def _set(self, reception: Reception, state: ReceiverState) -> None:
        change = (state in AWAITING_KV) - (reception.state in AWAITING_KV)
        reception.state = state
        if change:
            self._awaiting_kv += change
            self._backend.expect_notifications(self._awaiting_kv)

    def _forget(self, reception: Reception) -> None:
        self._receptions.pop(reception.request_id, None)
        self._by_token.pop(reception.token, None)

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
