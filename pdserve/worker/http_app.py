"""The worker process's HTTP edge: the internal API (pdserve/wire/protocol.py) over the worker's rank actors."""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

from pdserve.disagg.guard import HandoffGuard, HandoffRefused
from pdserve.http.internal_auth import InternalAuth
from pdserve.http.slow_clients import client_left
from pdserve.wire.protocol import (
    API_VERSION,
    AbortRequest,
    GenerateRequest,
    LoadReport,
    RankLoad,
    ReservationQuery,
    TokenEvent,
    WorkerHealth,
    WorkerInfo,
    coalesce_events,
)
from pdserve.worker.config import WorkerConfig
from pdserve.worker.drain import CountedStreamingResponse, DrainGate
from pdserve.worker.inprocess_rank import InProcessRank
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.prefill_start import start_prefill
from pdserve.worker.rank_actors import RankHandle

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 10.0
HEALTH_INTERVAL_S = 1.0
LOAD_TIMEOUT_S = 5.0  # the actor answers load from its snapshot: only a dead or restarting rank takes this long
Rank = RankHandle | InProcessRank  # a rank actor, or a rank in this process (the in-process cluster)


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

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        watcher = asyncio.create_task(ranks.watch())
        yield
        watcher.cancel()
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
        return Response(msgspec.json.encode(info), media_type="application/json")

    @app.get("/internal/v1/load")
    async def load() -> Response:
        loads = await asyncio.gather(*(h.load(CALL_TIMEOUT_S) for h in ranks.handles), return_exceptions=True)
        report = LoadReport([load for load in loads if not isinstance(load, BaseException)])
        return Response(msgspec.json.encode(report), media_type="application/json")

    @app.post("/internal/v1/generate")
    async def generate(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body(), type=GenerateRequest)
        except msgspec.DecodeError as error:  # ValidationError is a DecodeError
            return _error(400, f"bad generate request: {error}")
        if body.api_version != API_VERSION:
            return _error(400, f"api_version {body.api_version} not supported (this worker speaks {API_VERSION})")
        handle = rank_handle(body.rank)
        if handle is None:
            return _error(400, f"rank {body.rank} does not exist (this worker has {len(ranks.handles)})")
        if gate.draining:
            return _error(503, "worker is draining")
        if cfg.role == "prefill" and body.plan.kind == "decode" or cfg.role == "decode" and body.plan.kind == "prefill":
            return _error(400, f"a {cfg.role} worker does not take {body.plan.kind} plans")
        try:
            if body.plan.kind == "prefill":  # the rank computes while the reservation is confirmed
                with gate.counted():  # a drain waits for it; the response counts it afterwards (no await between)
                    stream = await start_prefill(guard, body, handle.generate)
            else:
                if body.plan.kind == "decode":
                    guard.check_decode_plan(body)
                stream = handle.generate(body)
        except HandoffRefused as refused:
            log.warning("refused a %s plan for %r: %s", body.plan.kind, body.request_id, refused)
            return _error(refused.status, str(refused))

        async def lines() -> AsyncIterator[bytes]:
            try:
                async for events in stream:  # what has come goes out in one write
                    yield b"".join(msgspec.json.encode(event) + b"\n" for event in coalesce_events(events))
            except Exception as error:  # noqa: BLE001 - a dead rank ends the stream with an error event
                event = TokenEvent(body.request_id, [], finish_reason="error", error=f"rank {body.rank} failed: {error}")
                yield msgspec.json.encode(event) + b"\n"

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
