"""The prefill side of the hand-off: compute a prompt, write its KV into the pages a decode rank reserved, then
answer with the first token. One `Sending` per request, in one `SenderState` at a time:

  COMPUTING  the engine prefills the prompt (prefill-only: it keeps the pages when it samples the first token)
  WRITING    one WRITE of the prompt's pages into the reservation is posted on the transfer backend's thread
  DONE       written (the decode rank was notified with the token); the first token sent; the pages released
  FAILED     the write deadline passed first, the write failed or timed out, or the request was aborted; the pages
             released, an error (or the abort) sent

The worker edge (`guard.py`) confirmed the reservation with the decode worker before the request got here, so the page
ids, deadline and peer come from the decode rank's own answer. Runs on the rank's event loop; the engine is reached
through `PrefillEngine` (the step thread), which hands back each finished prompt (`prefill_done`).
"""

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.cache.page_allocator import pages_for
from pdserve.disagg.counters import HandoffCounters
from pdserve.transfer.backend import TransferBackend, WriteResult
from pdserve.wire.protocol import GenerateRequest, Reservation, TokenEvent

log = logging.getLogger(__name__)


class SenderState(enum.Enum):
    COMPUTING = "computing"
    WRITING = "writing"
    DONE = "done"
    FAILED = "failed"


class ReservationMismatch(ValueError):
    """The reservation does not fit the prompt (another page size, or a page count that is not the prompt's)."""


class PrefillEngine(Protocol):
    """The engine, as the sender needs it."""

    async def add_prefill_only(self, request: GenerateRequest) -> None: ...

    async def release(self, request_id: str) -> None: ...

    async def abort(self, request_id: str) -> None: ...


@dataclass(eq=False)
class Sending:
    request_id: str
    token: str
    reservation: Reservation
    peer: str
    state: SenderState = SenderState.COMPUTING
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

    async def admit(self, request: GenerateRequest, reservation: Reservation) -> None:
        destination = request.plan.destination
        assert destination is not None
        num_pages = pages_for(len(request.prompt_token_ids), self._page_size)
        if len(reservation.page_ids) != num_pages or not 0 <= reservation.skip_pages <= num_pages:
            raise ReservationMismatch(
                f"reservation of {len(reservation.page_ids)} pages (skipping {reservation.skip_pages}) does not fit a "
                f"prompt of {len(request.prompt_token_ids)} tokens in pages of {self._page_size}")
        peer = await asyncio.wrap_future(self._backend.add_peer(reservation.agent_metadata))
        if peer != reservation.agent_name:
            raise ReservationMismatch(f"reservation names agent {reservation.agent_name!r}, its metadata {peer!r}")
        sending = Sending(request.request_id, destination.reservation_token, reservation, peer)
        self._sendings[sending.request_id] = sending
        try:
            await self._engine.add_prefill_only(request)
        except BaseException:
            self._sendings.pop(sending.request_id, None)
            raise

    def prefill_done(self, first: TokenEvent, page_ids: list[int]) -> None:
        """The engine sampled the first token and kept the prompt's `page_ids`: write them (on the loop)."""
        sending = self._sendings.get(first.request_id)
        if sending is None or sending.state is not SenderState.COMPUTING:  # aborted meanwhile
            self._spawn(self._engine.release(first.request_id))
            return
        reservation = sending.reservation
        if time.time() > reservation.write_deadline_unix_s:  # the decode rank has given up: its pages may be reused
            self._finish(sending, SenderState.FAILED,
                         TokenEvent(first.request_id, [], finish_reason="error",
                                    error="KV write deadline passed before the prefill finished"))
            return
        skip = reservation.skip_pages
        sending.state = SenderState.WRITING
        written = self._backend.write(sending.peer, page_ids[skip:], reservation.page_ids[skip:],
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
            sending.state = SenderState.FAILED
            await self._engine.abort(request_id)
        self._emit(TokenEvent(request_id, [], finish_reason="abort"))
        return True

    def fail_computing(self, message: str) -> None:
        """The engine step failed: every prompt still computing ends with an error."""
        for sending in [s for s in self._sendings.values() if s.state is SenderState.COMPUTING]:
            self._sendings.pop(sending.request_id)
            sending.state = SenderState.FAILED
            self._spawn(self._engine.abort(sending.request_id))
            self._emit(TokenEvent(sending.request_id, [], finish_reason="error", error=message))

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
