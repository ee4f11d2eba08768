"""A generate at the worker's edge, the same whichever way it came in (the worker channel or the HTTP route): the
request's checks, the start of its rank's stream (a prefill plan's confirm first), and its events as the edge sends
them."""

import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Union

from pdserve.disagg.guard import HandoffGuard, HandoffRefused
from pdserve.wire.channel import GenerateRefused
from pdserve.wire.protocol import API_VERSION, GenerateRequest, Role, TokenEvent, coalesce_events
from pdserve.worker.drain import DrainGate
from pdserve.worker.prefill_start import start_prefill
from pdserve.worker.rank_actors import RankHandle

if TYPE_CHECKING:  # a rank in process brings the engine and torch, which a worker process's edge does not import
    from pdserve.worker.inprocess_rank import InProcessRank

log = logging.getLogger(__name__)
Rank = Union[RankHandle, "InProcessRank"]  # a rank actor, or a rank in this process (the in-process cluster)


class GenerateEdge:
    """`handles`: the worker's ranks now (an expert-parallel instance replaces them on a restart)."""

    def __init__(self, role: Role, handles: Callable[[], list[Rank]], guard: HandoffGuard, gate: DrainGate) -> None:
        self._role = role
        self._handles = handles
        self._guard = guard
        self._gate = gate

    async def start(self, request: GenerateRequest) -> AsyncGenerator[list[TokenEvent], None]:
        """The request's event batches, coalesced, a rank's failure as a final error event; raises GenerateRefused
        with the status to answer. Not counted by the drain gate: each way in counts its streams."""
        if request.api_version != API_VERSION:
            raise GenerateRefused(400, f"api_version {request.api_version} not supported (this worker speaks "
                                       f"{API_VERSION})")
        handles = self._handles()
        if not 0 <= request.rank < len(handles):
            raise GenerateRefused(400, f"rank {request.rank} does not exist (this worker has {len(handles)})")
        handle = handles[request.rank]
        if self._gate.draining:
            raise GenerateRefused(503, "worker is draining")
        kind = request.plan.kind
        if self._role == "prefill" and kind == "decode" or self._role == "decode" and kind == "prefill":
            raise GenerateRefused(400, f"a {self._role} worker does not take {kind} plans")
        try:
            if kind == "prefill":  # the rank computes while the reservation is confirmed
                with self._gate.counted():  # a drain waits for it; the way in counts it afterwards (no await between)
                    stream = await start_prefill(self._guard, request, handle.generate)
            else:
                if kind == "decode":
                    self._guard.check_decode_plan(request)
                stream = handle.generate(request)
        except HandoffRefused as refused:
            log.warning("refused a %s plan for %r: %s", kind, request.request_id, refused)
            raise GenerateRefused(refused.status, str(refused)) from refused
        return self._events(request, stream)

    async def start_counted(self, request: GenerateRequest) -> AsyncGenerator[list[TokenEvent], None]:
        """start's stream, counted in flight by the drain gate from its first read until it ends or is closed (the
        worker channel reads it at once)."""
        return self._gate.counting(await self.start(request))

    @staticmethod
    async def _events(request: GenerateRequest,
                      stream: AsyncGenerator[list[TokenEvent], None]) -> AsyncGenerator[list[TokenEvent], None]:
        async with contextlib.aclosing(stream):  # closed early: the rank stops the request
            try:
                async for events in stream:  # what has come goes out in one write
                    yield coalesce_events(events)
            except Exception as error:  # noqa: BLE001 - a dead rank ends the stream with an error event
                yield [TokenEvent(request.request_id, [], finish_reason="error",
                                  error=f"rank {request.rank} failed: {error}")]
