"""The worker process's edge: the internal API (pdserve/wire/protocol.py) over the worker's rank actors, on its HTTP
port and, for generate streams, on the worker channel (pdserve/wire/channel.py) served in the same event loop."""

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

from pdserve.disagg.guard import HandoffGuard
from pdserve.http.internal_auth import InternalAuth
from pdserve.http.slow_clients import client_left
from pdserve.wire.channel import GenerateRefused
from pdserve.wire.channel_server import ChannelServer
from pdserve.wire.protocol import (
    AbortRequest,
    GenerateRequest,
    LoadReport,
    RankLoad,
    ReservationQuery,
    WorkerHealth,
    WorkerInfo,
)
from pdserve.worker.config import WorkerConfig
from pdserve.worker.drain import CountedStreamingResponse, DrainGate
from pdserve.worker.generate_edge import GenerateEdge, Rank
from pdserve.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 10.0
HEALTH_INTERVAL_S = 1.0
LOAD_TIMEOUT_S = 5.0  # the actor answers load from its snapshot: only a dead or restarting rank takes this long


def rank_condition(load: RankLoad | None, stuck_after_s: float) -> str:
    """ok; warming_up (a restarted rank: not ready yet); stuck (its step loop has not turned for `stuck_after_s`: a
    long step, like a kernel compiling, is not death, but this long is); down (it did not answer)."""
    if load is None:
        return "down"
    if load.loop_stalled_s > stuck_after_s:
        return "stuck"
    return "warming_up" if load.warming_up else "ok"


class RankSet:
    """The worker's ranks and what is known of their health, from the load each rank answers out of its snapshot
    (never waiting on its step thread). `restart`, when given (an expert-parallel instance), replaces every rank as
    soon as one is down or stuck; the worker is unhealthy until the new ranks have warmed up."""

    def __init__(self, handles: list[Rank],
                 restart: Callable[[], Awaitable[list[Rank]]] | None = None, stuck_after_s: float = 300.0):
        self.handles = handles
        self.conditions = ["ok"] * len(handles)
        self.stuck_after_s = stuck_after_s
        self._restart = restart

    @property
    def status(self) -> str:
        return "ok" if all(c == "ok" for c in self.conditions) else "unhealthy"

    async def check(self) -> None:
        loads = await asyncio.gather(*(h.load(LOAD_TIMEOUT_S) for h in self.handles), return_exceptions=True)
        for index, (handle, load) in enumerate(zip(self.handles, loads)):
            condition = rank_condition(None if isinstance(load, BaseException) else load, self.stuck_after_s)
            if condition != self.conditions[index]:
                log.warning("rank %s is %s (was %s)", handle.rank, condition, self.conditions[index])
            self.conditions[index] = condition

    async def watch(self) -> None:
        while True:
            await self.check()
            if self._restart is not None and any(c in ("down", "stuck") for c in self.conditions):
                try:
                    self.handles = await self._restart()
                    self.conditions = ["warming_up"] * len(self.handles)
                except Exception:  # noqa: BLE001 - retried on the next round; the worker stays unhealthy
                    log.exception("restarting the ranks failed")
                continue  # health is re-read from the new ranks before the worker reports ok
            await asyncio.sleep(HEALTH_INTERVAL_S)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}}, status)


def build_worker_app(cfg: WorkerConfig, ranks: RankSet, info: WorkerInfo, guard: HandoffGuard,
                     gate: DrainGate | None = None, ready_s: list[float] | None = None) -> FastAPI:
    """`guard`: the checks on hand-off plans (peers from discovery); `ready_s`: per rank, the seconds from the worker's
    start until the rank was ready."""
    gate = gate or DrainGate()
    metrics = WorkerMetrics(info.model, cfg.role)
    for rank, seconds in enumerate(ready_s or []):
        metrics.start_seconds.labels(info.model, cfg.role, str(rank)).set(seconds)

    edge = GenerateEdge(cfg.role, lambda: ranks.handles, guard, gate)
    channel = ChannelServer(cfg.internal_token, edge.start_counted)
    served_info = info  # channel_port 0 until the channel listens

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal served_info
        served_info = dataclasses.replace(info, channel_port=await channel.serve(cfg.host, cfg.channel_port))
        watcher = asyncio.create_task(ranks.watch())
        yield
        watcher.cancel()
        await channel.close()
        await guard.close()

    app = FastAPI(title="pdserve worker", lifespan=lifespan)
    app.add_middleware(InternalAuth, token=cfg.internal_token)

    app.add_exception_handler(ClientDisconnect, client_left)

    def rank_handle(rank: int) -> Rank | None:
        return ranks.handles[rank] if 0 <= rank < len(ranks.handles) else None

    @app.get("/health")
    async def health() -> Response:
        body = WorkerHealth("draining" if gate.draining else ranks.status, cfg.role, len(ranks.handles))  # type: ignore[arg-type]
        return Response(msgspec.json.encode(body), 200 if body.status == "ok" else 503, media_type="application/json")

    @app.get("/internal/v1/info")
    async def worker_info() -> Response:
        return Response(msgspec.json.encode(served_info), media_type="application/json")

    @app.get("/internal/v1/load")
    async def load() -> Response:
        loads = await asyncio.gather(*(h.load(CALL_TIMEOUT_S) for h in ranks.handles), return_exceptions=True)
        report = LoadReport([load for load in loads if not isinstance(load, BaseException)])
        return Response(msgspec.json.encode(report), media_type="application/json")

    # Callers stream generates over the worker channel; this route is the same generate for an operator with curl.
    @app.post("/internal/v1/generate")
    async def generate(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body(), type=GenerateRequest)
        except msgspec.DecodeError as error:  # ValidationError is a DecodeError
            return _error(400, f"bad generate request: {error}")
        try:
            stream = await edge.start(body)
        except GenerateRefused as refused:
            return _error(refused.status, refused.message)

        async def lines() -> AsyncIterator[bytes]:
            async for events in stream:
                yield b"".join(msgspec.json.encode(event) + b"\n" for event in events)

        return CountedStreamingResponse(lines(), gate, media_type="application/x-ndjson")

    @app.post("/internal/v1/abort")
    async def abort(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body(), type=AbortRequest)
        except msgspec.DecodeError as error:
            return _error(400, f"bad abort request: {error}")
        found = await asyncio.gather(*(h.abort(body.request_id, CALL_TIMEOUT_S) for h in ranks.handles),
                                     return_exceptions=True)
        return JSONResponse({"aborted": any(f is True for f in found)})

    @app.get("/internal/v1/kv_events")
    async def kv_events(rank: int, after: int = -1) -> Response:
        handle = rank_handle(rank)
        if handle is None:
            return _error(400, f"rank {rank} does not exist")

        async def lines() -> AsyncIterator[bytes]:
            seq = after
            while True:
                try:
                    batches = await handle.kv_events_after(seq, CALL_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - the rank is gone: end the stream, the router resubscribes
                    return
                for batch in batches:  # none: the rank's long poll ran out; ask again
                    seq = batch.seq
                    yield msgspec.json.encode(batch) + b"\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/internal/v1/transfer/reservation")
    async def transfer_reservation(request: Request) -> Response:
        """A prefill worker asks for the reservation its plan names; only the holder of the token gets it, once."""
        try:
            query = msgspec.json.decode(await request.body(), type=ReservationQuery)
        except msgspec.DecodeError as error:
            return _error(400, f"bad reservation query: {error}")
        handle = rank_handle(query.rank)
        if handle is None:
            return _error(400, f"rank {query.rank} does not exist")
        # Answered once the pages are reserved, which may wait for room up to the prefill timeout.
        reservation = await handle.confirm_reservation(query, cfg.prefill_timeout_s + CALL_TIMEOUT_S)
        if reservation is None:
            return _error(403, "no reservation awaits a prefill with that request id and token")
        return Response(msgspec.json.encode(reservation), media_type="application/json")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        for handle in ranks.handles:
            with contextlib.suppress(Exception):
                metrics.update(handle.rank, await handle.stats(CALL_TIMEOUT_S))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
