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

from pdserve.http.internal_auth import InternalAuth
from pdserve.http.slow_clients import client_left
from pdserve.wire.protocol import (
    API_VERSION,
    AbortRequest,
    GenerateRequest,
    LoadReport,
    TokenEvent,
    WorkerHealth,
    WorkerInfo,
)
from pdserve.worker.config import WorkerConfig
from pdserve.worker.drain import CountedStreamingResponse, DrainGate
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.rank_actors import RankHandle

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 10.0
HEALTH_INTERVAL_S = 1.0
KV_EVENT_POLL_S = 0.05


class RankSet:
    """The worker's ranks and what is known of their health. `restart`, when given (an expert-parallel instance),
    replaces every rank as soon as one stops answering; the worker is unhealthy until the new ranks answer."""

    def __init__(self, handles: list[RankHandle],
                 restart: Callable[[], Awaitable[list[RankHandle]]] | None = None):
        self.handles = handles
        self.healthy = [True] * len(handles)
        self._restart = restart

    @property
    def status(self) -> str:
        return "ok" if all(self.healthy) else "unhealthy"

    async def watch(self) -> None:
        """Marks a rank unhealthy while it does not answer (dead, or restarting under Ray)."""
        while True:
            for index, handle in enumerate(self.handles):
                try:
                    await handle.load(timeout_s=5.0)
                    self.healthy[index] = True
                except Exception:  # noqa: BLE001 - any failure to answer means unhealthy
                    if self.healthy[index]:
                        log.warning("rank %s is not answering", handle.rank)
                    self.healthy[index] = False
            if self._restart is not None and not all(self.healthy):
                try:
                    self.handles = await self._restart()
                except Exception:  # noqa: BLE001 - retried on the next round; the worker stays unhealthy
                    log.exception("restarting the ranks failed")
                continue  # health is re-read from the new ranks before the worker reports ok
            await asyncio.sleep(HEALTH_INTERVAL_S)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}}, status)


def build_worker_app(cfg: WorkerConfig, ranks: RankSet, info: WorkerInfo, gate: DrainGate | None = None) -> FastAPI:
    gate = gate or DrainGate()
    metrics = WorkerMetrics(info.model, cfg.role)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        watcher = asyncio.create_task(ranks.watch())
        yield
        watcher.cancel()

    app = FastAPI(title="pdserve worker", lifespan=lifespan)
    app.add_middleware(InternalAuth, token=cfg.internal_token)

    app.add_exception_handler(ClientDisconnect, client_left)

    def rank_handle(rank: int) -> RankHandle | None:
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

        async def lines() -> AsyncIterator[bytes]:
            try:
                async for event in handle.generate(body):
                    yield msgspec.json.encode(event) + b"\n"
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
                for batch in batches:
                    seq = batch.seq
                    yield msgspec.json.encode(batch) + b"\n"
                if not batches:
                    await asyncio.sleep(KV_EVENT_POLL_S)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get("/internal/v1/transfer/metadata")
    async def transfer_metadata(rank: int) -> Response:
        handle = rank_handle(rank)
        if handle is None:
            return _error(400, f"rank {rank} does not exist")
        return Response(msgspec.json.encode(await handle.transfer_metadata(CALL_TIMEOUT_S)), media_type="application/json")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        for handle in ranks.handles:
            with contextlib.suppress(Exception):
                engine_stats, counters = await handle.stats(CALL_TIMEOUT_S)
                metrics.update(handle.rank, engine_stats, counters)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
