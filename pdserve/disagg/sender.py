"""The prefill side of the hand-off: compute a prompt, write its KV into the pages a decode rank reserved, then
answer with the first token. One `Sending` per request, in one `SenderState` at a time:

  COMPUTING  the engine prefills the prompt (prefill-only: it keeps the pages when it samples the first token); the
             reservation may be confirmed meanwhile
  COMPUTED   the first token is sampled and the pages kept, the reservation not confirmed yet: written once it is
  WRITING    one WRITE of the prompt's pages into the reservation is posted on the transfer backend's thread
  DONE       written (the decode rank was notified with the token); the first token sent; the pages released
  FAILED     the reservation was refused or does not fit the prompt, the write deadline passed first, the write failed
             or timed out, or the request was aborted; the pages released, an error (or the abort) sent

The worker edge (`guard.py`) confirms the reservation with the decode worker while the prompt computes and hands it
over as a future: the page ids, deadline and peer come from the decode rank's own answer, and nothing is written
before it. It is checked when it comes (its pages fit the prompt, its metadata names its agent). Runs on the rank's
event loop; the engine is reached through `PrefillEngine` (the step thread), which hands back each finished prompt
(`prefill_done`).
"""

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.cache.page_allocator import pages_for
from pdserve.disagg.counters import HandoffCounters
from pdserve.transfer.backend import TransferBackend, WriteResult
from pdserve.wire.protocol import GenerateRequest, Reservation, TokenEvent

log = logging.getLogger(__name__)


class SenderState(enum.Enum):
    COMPUTING = "computing"
    COMPUTED = "computed"
    WRITING = "writing"
    DONE = "done"
    FAILED = "failed"


class PrefillEngine(Protocol):
    """The engine, as the sender needs it."""

    async def add_prefill_only(self, request: GenerateRequest) -> None: ...

    async def release(self, request_id: str) -> None: ...

    async def abort(self, request_id: str) -> None: ...


@dataclass(eq=False)
class Sending:
    request_id: str
    token: str
    num_pages: int  # the prompt's: the reservation must have as many
    state: SenderState = SenderState.COMPUTING
    reservation: Reservation | None = None  # once confirmed and checked
    peer: str = ""
    first: TokenEvent | None = None  # from COMPUTED on: the first token, sent once written
    page_ids: list[int] = field(default_factory=list)  # from COMPUTED on: the prompt's pages, kept for the write
    aborted: bool = False  # the caller went away while WRITING: the write finishes, nobody hears of it


class Sender:
    def __init__(self, page_size: int, transfer_timeout_s: float, backend: TransferBackend, engine: PrefillEngine,
                 emit: Callable[[TokenEvent], None], counters: HandoffCounters):
        self._page_size = page_size
        self._transfer_timeout_s = transfer_timeout_s
        self._backend = backend
        self._engine = engine
        self._emit = emit
        self._counters = counters
        self._sendings: dict[str, Sending] = {}
        self._background: set[asyncio.Task] = set()

    def holds(self, request_id: str) -> bool:
        return request_id in self._sendings

    def state_of(self, request_id: str) -> SenderState | None:
        sending = self._sendings.get(request_id)
        return sending.state if sending else None

    def confirmed(self, request_id: str) -> bool:
        """Whether the request's reservation has come and fits."""
        sending = self._sendings.get(request_id)
        return sending is not None and sending.reservation is not None

    async def admit(self, request: GenerateRequest, reservation: asyncio.Future[Reservation]) -> None:
        """Starts the prompt at once; `reservation` is the worker edge's confirm, still under way (a failed or
        cancelled one ends the request)."""
        destination = request.plan.destination
        assert destination is not None
        num_pages = pages_for(len(request.prompt_token_ids), self._page_size)
        sending = Sending(request.request_id, destination.reservation_token, num_pages)
        self._sendings[sending.request_id] = sending
        try:
            await self._engine.add_prefill_only(request)
        except BaseException:
            self._sendings.pop(sending.request_id, None)
            raise
        reservation.add_done_callback(lambda confirm: self._spawn(self._confirmed(sending, confirm)))

    async def _confirmed(self, sending: Sending, confirm: asyncio.Future[Reservation]) -> None:
        """The worker edge's confirm came: a reservation that fits is written into, at once if the prompt is computed;
        a refused, failed or unfitting one ends the request."""
        if sending.state not in (SenderState.COMPUTING, SenderState.COMPUTED):
            return  # aborted meanwhile
        if confirm.cancelled():
            self._abandon(sending, "the reservation was not confirmed: the worker edge gave up on it")
            return
        if (error := confirm.exception()) is not None:
            self._abandon(sending, f"the reservation was not confirmed: {error}")
            return
        reservation = confirm.result()
        problem = self._misfit(reservation, sending.num_pages)
        peer = ""
        if problem is None:
            try:
                peer = await asyncio.wrap_future(self._backend.add_peer(reservation.agent_metadata))
            except Exception as error:  # noqa: BLE001 - a peer that cannot be added ends the request as a misfit does
                problem = f"the reservation's peer could not be added: {error}"
            else:
                if peer != reservation.agent_name:
                    problem = f"reservation names agent {reservation.agent_name!r}, its metadata {peer!r}"
        if problem is not None:
            self._abandon(sending, problem)
        elif sending.state in (SenderState.COMPUTING, SenderState.COMPUTED):  # not aborted while the peer was added
            sending.reservation, sending.peer = reservation, peer
            if sending.state is SenderState.COMPUTED:
                self._write(sending)

    def _misfit(self, reservation: Reservation, num_pages: int) -> str | None:
        """Why the reservation cannot take the prompt's pages (another page size, or another page count), if so."""
        if len(reservation.page_ids) == num_pages and 0 <= reservation.skip_pages <= num_pages:
            return None
        return (f"reservation of {len(reservation.page_ids)} pages (skipping {reservation.skip_pages}) does not fit "
                f"a prompt of {num_pages} pages of {self._page_size} tokens")

    def prefill_done(self, first: TokenEvent, page_ids: list[int]) -> None:
        """The engine sampled the first token and kept the prompt's `page_ids`: write them once the reservation is
        confirmed (on the loop)."""
        sending = self._sendings.get(first.request_id)
        if sending is None or sending.state is not SenderState.COMPUTING:  # aborted meanwhile
            self._spawn(self._engine.release(first.request_id))
            return
        sending.first, sending.page_ids = first, page_ids
        if sending.reservation is None:
            sending.state = SenderState.COMPUTED
        else:
            self._write(sending)

    def _write(self, sending: Sending) -> None:
        reservation, first = sending.reservation, sending.first
        assert reservation is not None and first is not None
        if time.time() > reservation.write_deadline_unix_s:  # the decode rank has given up: its pages may be reused
            self._finish(sending, SenderState.FAILED,
                         TokenEvent(first.request_id, [], finish_reason="error",
                                    error="KV write deadline passed before the prefill finished"))
            return
        skip = reservation.skip_pages
        sending.state = SenderState.WRITING
        written = self._backend.write(sending.peer, sending.page_ids[skip:], reservation.page_ids[skip:],
                                      sending.token.encode(), min(self._transfer_timeout_s, reservation.transfer_timeout_s))
        asyncio.wrap_future(written).add_done_callback(lambda _: self._written(sending, first, written))

    async def abort(self, request_id: str) -> bool:
        sending = self._sendings.get(request_id)
        if sending is None:
            return False
        if sending.state is SenderState.WRITING:
            sending.aborted = True  # the pages are released when the write completes: it still reads them
        else:
            self._sendings.pop(request_id, None)
            await self._fail(sending)
        self._emit(TokenEvent(request_id, [], finish_reason="abort"))
        return True

    def fail_computing(self, message: str) -> None:
        """The engine step failed: every prompt still computing ends with an error."""
        for sending in [s for s in self._sendings.values() if s.state is SenderState.COMPUTING]:
            self._abandon(sending, message)

    def _abandon(self, sending: Sending, message: str) -> None:
        """Ends a request whose prompt is computing or computed, before any write: its pages freed, an error sent."""
        if sending.state not in (SenderState.COMPUTING, SenderState.COMPUTED):
            return  # already ended (an abort came first)
        self._sendings.pop(sending.request_id, None)
        self._spawn(self._fail(sending))
        self._emit(TokenEvent(sending.request_id, [], finish_reason="error", error=message))

    def _fail(self, sending: Sending) -> Coroutine[Any, Any, None]:
        """FAILED; returns the engine call that frees the pages (a computed prompt kept them, a computing one is
        aborted)."""
        free = self._engine.release if sending.state is SenderState.COMPUTED else self._engine.abort
        sending.state = SenderState.FAILED
        return free(sending.request_id)

    def _written(self, sending: Sending, first: TokenEvent, written: Future[WriteResult]) -> None:
        error = written.exception()
        if error is None:
            result = written.result()
            self._counters.kv_transfer_bytes += result.num_bytes
            self._counters.kv_transfer_descriptors += result.num_descriptors
            self._counters.kv_transfer_posting_seconds += result.posting_seconds
            self._counters.kv_transfer_queued_seconds += result.queued_seconds
            self._counters.kv_transfer_post_call_seconds += result.post_call_seconds
            self._counters.kv_transfer_seconds.append(result.seconds)
            self._finish(sending, SenderState.DONE, first)
        else:
            log.warning("request %s: KV write failed: %s", sending.request_id, error)
            self._finish(sending, SenderState.FAILED,
                         TokenEvent(sending.request_id, [], finish_reason="error", error=f"KV transfer failed: {error}"))

    def _finish(self, sending: Sending, state: SenderState, event: TokenEvent) -> None:
        sending.state = state
        if state is SenderState.FAILED:
            self._counters.kv_transfer_failures += 1
        self._sendings.pop(sending.request_id, None)
        self._spawn(self._engine.release(sending.request_id))
        if not sending.aborted:
            self._emit(event)

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
