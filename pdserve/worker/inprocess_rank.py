"""A rank driven in the worker's own process: the calls of a Ray rank handle (rank_actors.RankHandle), made straight
on a RankRuntime. The in-process cluster (pdserve/cluster/inprocess.py) serves its workers' ranks this way; an
expert-parallel instance needs a process per rank and keeps its actors."""

import asyncio
from collections.abc import AsyncGenerator, Awaitable

from pdserve.wire.protocol import (
    GenerateRequest,
    KVEventBatch,
    RankInfo,
    RankLoad,
    Reservation,
    ReservationQuery,
    TokenEvent,
)
from pdserve.worker.rank_config import RankStats
from pdserve.worker.rank_runtime import RankRuntime


class InProcessRank:
    """Its first call binds the runtime to the running event loop, which must then serve every later call."""

    def __init__(self, runtime: RankRuntime):
        self.rank = runtime.cfg.rank
        self.runtime = runtime

    def _started(self) -> RankRuntime:
        self.runtime.serve_here()
        return self.runtime

    async def info(self, timeout_s: float) -> RankInfo:
        runtime = self._started()
        await asyncio.wait_for(runtime.ready(), timeout_s)
        return runtime.info()

    async def generate(self, request: GenerateRequest,
                       reservation: Awaitable[Reservation] | None = None) -> AsyncGenerator[list[TokenEvent], None]:
        async for event in self._started().generate(request, reservation):
            yield [event]

    async def abort(self, request_id: str, timeout_s: float) -> bool:
        return await asyncio.wait_for(self._started().abort(request_id), timeout_s)

    async def load(self, timeout_s: float) -> RankLoad:
        return self._started().load()

    async def stats(self, timeout_s: float) -> RankStats:
        return self._started().stats()

    async def confirm_reservation(self, query: ReservationQuery, timeout_s: float) -> Reservation | None:
        return await asyncio.wait_for(self._started().confirm_reservation(query), timeout_s)

    async def kv_events_after(self, after: int, timeout_s: float) -> list[KVEventBatch]:
        return await asyncio.wait_for(self._started().kv_events_after(after), timeout_s)

    def stop(self) -> None:
        self.runtime.stop()
