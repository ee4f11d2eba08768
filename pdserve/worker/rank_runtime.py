"""One DP rank: its engine, stepped by a thread of its own, its NIXL agent, and the three request plans.

Queues a request passes through:
  both:    engine.waiting -> engine.running -> stream
  prefill: engine (max_tokens=1, pages kept) -> `_transfers` (NIXL WRITE in flight) -> pages released -> stream
  decode:  pages reserved -> prefill worker called over HTTP -> `_notified` (NIXL notification seen)
           -> engine.running from the prefill's first token -> stream
The engine and the agent are touched only by the step thread; async callers hand it closures (`_call`).
"""

import asyncio
import base64
import concurrent.futures
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import torch.distributed as dist

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine, InvalidRequestError, NoCapacityError, RequestOutput
from pdserve.engine.lockstep import Lockstep
from pdserve.http.internal_auth import bearer_headers
from pdserve.model.config import ModelConfig
from pdserve.ops.moe import ExpertRange
from pdserve.ops.moe_ep import ExpertParallelMoE, expert_owner_range
from pdserve.transfer.agent import KVTransferAgent, TransferError, TransferHandle
from pdserve.wire.client import WorkerClient, WorkerUnavailable
from pdserve.wire.protocol import (
    GenerateRequest,
    KVDestination,
    KVEventBatch,
    RankInfo,
    RankLoad,
    Role,
    TokenEvent,
    TransferMetadata,
)
from pdserve.worker.kv_event_log import KVEventLog

log = logging.getLogger(__name__)
T = TypeVar("T")
CLOCK_MARGIN_S = 1.0  # allowed disagreement between host clocks for KV write deadlines


@dataclass(frozen=True)
class RankConfig:
    rank: int
    role: Role
    engine: EngineConfig
    worker_url: str  # where peers reach this rank's worker (metadata, generate)
    transfer_timeout_s: float = 30.0
    prefill_timeout_s: float = 120.0
    world_size: int = 1  # ranks of this worker
    expert_parallel: bool = False  # the ranks share the routed experts over the default process group
    internal_token: str = field(default="", repr=False)  # sent on this rank's calls to prefill workers


class InstanceBroken(RuntimeError):
    """An expert-parallel rank lost its peers (a collective failed); the instance must be re-formed."""


@dataclass
class RankCounters:
    """Cumulative figures the worker turns into Prometheus metrics."""

    kv_transfer_bytes: int = 0
    kv_transfer_failures: int = 0
    kv_transfer_seconds: list[float] = field(default_factory=list)  # drained by each metrics read


@dataclass
class _Transfer:
    handle: TransferHandle
    output: RequestOutput
    deadline_s: float


class RankRuntime:
    def __init__(self, cfg: RankConfig):
        self.cfg = cfg
        self.kv_events = KVEventLog(cfg.rank)
        self.lockstep: Lockstep | None = None
        if cfg.expert_parallel:
            self.engine, self.lockstep = self._expert_parallel_engine(cfg)
        else:
            self.engine = Engine(cfg.engine, on_kv_events=self.kv_events.record)
        name = f"{cfg.role}-r{cfg.rank}-{uuid.uuid4().hex[:12]}"  # new per start: peers re-learn a restarted rank
        self.agent = KVTransferAgent(name, self.engine.runner.kv_cache, progress_thread=False)
        self.counters = RankCounters()
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.Queue()
        self._streams: dict[str, asyncio.Queue[TokenEvent]] = {}
        # prefill request -> (peer, where to write, Unix time after which it must not write)
        self._destinations: dict[str, tuple[str, KVDestination, float]] = {}
        self._quarantined: set[str] = set()  # failed decode reservations held until a late WRITE cannot land
        self._quarantine_tasks: set[asyncio.Task] = set()
        self._transfers: dict[str, _Transfer] = {}
        self._notified: set[str] = set()
        self._known_peers: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http = httpx.AsyncClient(headers=bearer_headers(cfg.internal_token))
        self._broken: str | None = None

    def _expert_parallel_engine(self, cfg: RankConfig) -> tuple[Engine, Lockstep]:
        """This rank's experts and the exchange over the default process group (the actor has joined it)."""
        num_experts = ModelConfig.from_dir(cfg.engine.model).n_routed_experts
        experts = ExpertRange(*expert_owner_range(dist.get_rank(), dist.get_world_size(), num_experts))
        engine = Engine(cfg.engine, experts, self.kv_events.record,
                        wrap_moe=lambda local: ExpertParallelMoE(None, num_experts, local))
        log.info("rank %s of %s: routed experts [%s, %s), %.1f MiB of expert weights", cfg.rank, cfg.world_size,
                 experts.first, experts.first + experts.count, engine.runner.model.routed_expert_bytes() / 2**20)
        return engine, Lockstep(None, engine.device)

    # --- lifecycle --------------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._thread is None:
            self._loop = loop
            self._thread = threading.Thread(target=self._run, name=f"rank-{self.cfg.rank}-step", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.agent.close()

    def info(self) -> RankInfo:
        return RankInfo(self.cfg.rank, self.cfg.engine.page_size, self.engine.allocator.num_pages, self.agent.name)

    def transfer_metadata(self) -> TransferMetadata:
        blob = base64.b64encode(self.agent.metadata()).decode()
        return TransferMetadata(self.cfg.rank, self.agent.name, blob)

    async def load(self) -> RankLoad:
        stats = await self._call(self.engine.stats)
        return RankLoad(self.cfg.rank, stats.running, stats.waiting, stats.free_pages, stats.total_pages,
                        stats.prefix_cache_pages)

    async def stats(self) -> tuple[Any, RankCounters]:
        def snapshot():
            counters = RankCounters(self.counters.kv_transfer_bytes, self.counters.kv_transfer_failures,
                                    self.counters.kv_transfer_seconds)
            self.counters.kv_transfer_seconds = []
            return self.engine.stats(), counters

        return await self._call(snapshot)

    # --- requests ---------------------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        stream: asyncio.Queue[TokenEvent] = asyncio.Queue()
        request_id = request.request_id
        if request_id in self._streams:
            yield self._error(request_id, f"request id {request_id!r} is already running on this rank")
            return
        self._streams[request_id] = stream
        try:
            first = await self._admit(request)
            if first is not None:
                yield first
                if first.finish_reason is not None:
                    return
            while True:
                event = await stream.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self._streams.pop(request_id, None)
            if request_id in self.engine.requests and request_id not in self._quarantined:  # caller went away
                await self._call(lambda: self.engine.abort(request_id))

    async def abort(self, request_id: str) -> bool:
        found = await self._call(lambda: self.engine.abort(request_id))
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(TokenEvent(request_id, [], finish_reason="abort"))
        return found

    async def _admit(self, request: GenerateRequest) -> TokenEvent | None:
        """Start the request per its plan; returns a first event to emit at once (errors, the decode's first token)."""
        plan, request_id = request.plan, request.request_id
        try:
            if plan.kind == "both":
                await self._call(lambda: self.engine.add_request(request_id, request.prompt_token_ids, request.sampling))
                return None
            if plan.kind == "prefill":
                if plan.destination is None:
                    return self._error(request_id, "a prefill plan needs a destination")
                peer = await self._learn_peer(plan.destination)
                self._destinations[request_id] = (peer, plan.destination, plan.destination.write_deadline_unix_s or math.inf)
                await self._call(
                    lambda: self.engine.add_prefill_only(request_id, request.prompt_token_ids, request.sampling)
                )
                return None
            if plan.prefill is None:
                return self._error(request_id, "a decode plan needs a prefill source")
            return await self._decode_after_transfer(request)
        except (InvalidRequestError, NoCapacityError, TransferError, WorkerUnavailable, httpx.HTTPError) as error:
            self._destinations.pop(request_id, None)
            return self._error(request_id, str(error))

    async def _decode_after_transfer(self, request: GenerateRequest) -> TokenEvent:
        request_id, source = request.request_id, request.plan.prefill
        assert source is not None
        reserved = await self._call(
            lambda: self.engine.reserve(request_id, request.prompt_token_ids, request.sampling)
        )
        write_deadline_unix_s = time.time() + self.cfg.prefill_timeout_s
        destination = KVDestination(self.cfg.worker_url, self.cfg.rank, self.agent.name, list(reserved.page_ids),
                                    write_deadline_unix_s=write_deadline_unix_s)
        prefill_request = GenerateRequest(
            request_id=request_id, rank=source.rank, prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling, plan=type(request.plan)(kind="prefill", destination=destination),
        )
        first: TokenEvent | None = None
        prefill_client = WorkerClient(source.url, self._http)
        try:
            async for event in prefill_client.generate(prefill_request, self.cfg.prefill_timeout_s):
                first = event
                if event.finish_reason is not None:
                    break
            if first is None or first.finish_reason == "error" or not first.token_ids:
                raise WorkerUnavailable(f"prefill failed: {first.error if first else 'no answer'}", refused=first is not None)
            await self._wait_notified(request_id)
        except BaseException as error:
            if isinstance(error, WorkerUnavailable) and error.refused:
                await self._call(lambda: self.engine.abort(request_id))
            else:
                await prefill_client.abort(request_id)
                # the prefill may still post a WRITE until the deadline: keep the pages out of use until it can't land
                quarantine_s = write_deadline_unix_s + self.cfg.transfer_timeout_s + CLOCK_MARGIN_S - time.time()
                self._quarantined.add(request_id)
                task = asyncio.create_task(self._abort_after(request_id, quarantine_s))
                self._quarantine_tasks.add(task)
                task.add_done_callback(self._quarantine_tasks.discard)
            raise
        sampled = RequestOutput(request_id, first.token_ids[:1], first.logprobs[:1] if first.logprobs else None,
                                first.top_token_ids, first.top_logprobs)
        output = await self._call(lambda: self.engine.start_decoding(request_id, sampled))
        event = self._event(output)
        event.cached_tokens = first.cached_tokens
        return event

    async def _abort_after(self, request_id: str, delay_s: float) -> None:
        await asyncio.sleep(max(0.0, delay_s))
        await self._call(lambda: self.engine.abort(request_id))
        self._quarantined.discard(request_id)

    async def _wait_notified(self, request_id: str) -> None:
        deadline = time.monotonic() + self.cfg.transfer_timeout_s
        while request_id not in self._notified:
            if time.monotonic() > deadline:
                raise TransferError(f"KV of {request_id} did not arrive within {self.cfg.transfer_timeout_s} s")
            await asyncio.sleep(0.002)
        self._notified.discard(request_id)

    async def _learn_peer(self, destination: KVDestination) -> str:
        if destination.agent_name in self._known_peers:
            return destination.agent_name
        response = await self._http.get(
            f"{destination.url.rstrip('/')}/internal/v1/transfer/metadata", params={"rank": destination.rank},
            timeout=10.0,
        )
        response.raise_for_status()
        blob = base64.b64decode(response.json()["agent_metadata_b64"])
        name = await self._call(lambda: self.agent.add_peer(blob))
        if name != destination.agent_name:
            raise TransferError(f"decode rank at {destination.url} is now {name}, not {destination.agent_name}")
        self._known_peers.add(name)
        return name

    # --- the step thread --------------------------------------------------------------------------------------
    async def _call(self, fn: Callable[[], T]) -> T:
        if self._broken is not None:
            raise InstanceBroken(self._broken)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        if self._broken is not None:  # broke while we queued: fail what the step thread will never run
            self._break(self._broken)
        return await asyncio.wrap_future(future)

    def _run(self) -> None:
        while not self._stop.is_set():
            idle = not (self.engine.has_work() or self._transfers)
            self._run_commands(block=idle)
            try:
                for output in self._step():
                    self._route_output(output)
                self._progress_transfers()
            except Exception:  # noqa: BLE001 - a step failure must reach every caller, not kill the thread silently
                log.exception("rank %s step failed", self.cfg.rank)
                self._fail_everything("engine step failed")
                if self.lockstep is not None:  # a peer is gone: no later collective can succeed
                    self._break(f"rank {self.cfg.rank} lost its expert-parallel peers")
                    return

    def _step(self) -> list[RequestOutput]:
        if self.lockstep is None:
            return self.engine.step()
        busy = self.lockstep.any_rank_busy(self.engine.has_work() or bool(self._transfers))
        return self.engine.step(force_forward=True) if busy else []

    def _break(self, message: str) -> None:
        """Stop taking work and fail whatever is queued, so no caller waits on a step thread that has ended."""
        self._broken = message
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(InstanceBroken(message))

    def _run_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(timeout=0.005 if block else 0)
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as error:  # noqa: BLE001 - handed to the awaiting caller
                    future.set_exception(error)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _route_output(self, output: RequestOutput) -> None:
        target = self._destinations.pop(output.request_id, None)
        if target is None:
            self._emit(self._event(output))
            return
        peer, destination, write_deadline_s = target
        request = self.engine.requests[output.request_id]
        if time.time() > write_deadline_s:  # the decode rank has given up: its pages may be someone else's now
            self.engine.release(output.request_id)
            self.counters.kv_transfer_failures += 1
            self._emit(self._error(output.request_id, "KV write deadline passed before the prefill finished"))
            return
        pages = slice(destination.skip_pages, len(destination.page_ids))
        try:
            handle = self.agent.write_pages(peer, request.page_ids[pages], destination.page_ids[pages],
                                            output.request_id.encode())
        except TransferError as error:
            self.engine.release(output.request_id)
            self.counters.kv_transfer_failures += 1
            self._emit(self._error(output.request_id, f"KV transfer failed: {error}"))
            return
        self._transfers[output.request_id] = _Transfer(handle, output, time.monotonic() + self.cfg.transfer_timeout_s)

    def _progress_transfers(self) -> None:
        for peer, notif in self.agent.take_notifications():
            self._notified.add(notif.decode())
        for request_id, transfer in list(self._transfers.items()):
            state = self.agent.poll(transfer.handle)
            if state == "pending" and time.monotonic() < transfer.deadline_s:
                continue
            del self._transfers[request_id]
            self.agent.release(transfer.handle)
            self.engine.release(request_id)
            if state == "done":
                self.counters.kv_transfer_bytes += transfer.handle.num_bytes
                self.counters.kv_transfer_seconds.append(time.monotonic() - transfer.handle.started_s)
                self._emit(self._event(transfer.output))
            else:
                self.counters.kv_transfer_failures += 1
                reason = "timed out" if state == "pending" else transfer.handle.error
                self._emit(self._error(request_id, f"KV transfer {reason}"))

    def _fail_everything(self, message: str) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._emit(self._error(request_id, message))

    def _emit(self, event: TokenEvent) -> None:
        stream = self._streams.get(event.request_id)
        if stream is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(stream.put_nowait, event)

    async def kv_events_after(self, after: int) -> list[KVEventBatch]:
        return await self._call(lambda: self.kv_events.after(after, self.engine.prefix_cache.stored_blocks))

    # --- events ---------------------------------------------------------------------------------------------
    def _event(self, output: RequestOutput) -> TokenEvent:
        return TokenEvent(
            request_id=output.request_id, token_ids=output.new_token_ids, text=output.text,
            logprobs=output.new_logprobs, top_token_ids=output.new_top_token_ids, top_logprobs=output.new_top_logprobs,
            finish_reason=output.finish_reason,  # type: ignore[arg-type]
            prompt_tokens=output.prompt_tokens, cached_tokens=output.cached_tokens,
        )

    @staticmethod
    def _error(request_id: str, message: str) -> TokenEvent:
        return TokenEvent(request_id, [], finish_reason="error", error=message)
