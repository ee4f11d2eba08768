"""One DP rank: its engine, stepped by a thread of its own; the two hand-off roles (pdserve/disagg) over a transfer
backend; and the three request plans.

Queues a request passes through:
  both:    engine.waiting -> engine.running -> stream
  prefill: disagg Sender: COMPUTING (engine, pages kept) [-> COMPUTED (the reservation's confirm not in yet)]
           -> WRITING (transfer thread) -> DONE -> stream
  decode:  disagg Receiver: RESERVING -> PREFILL_REQUESTED -> CONFIRMED -> FIRST_TOKEN -> KV_ARRIVED -> DECODING
           (engine.running from the prefill's first token) -> stream
The engine is touched only by its step thread (`step_loop.py`); async callers hand it closures. Load, stats and
health come from the snapshot that thread publishes, never waiting on it.
"""

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable

import torch
import torch.distributed as dist

from pdserve.cache.page_allocator import pages_for
from pdserve.disagg.counters import HandoffCounters
from pdserve.disagg.receiver import (
    HandoffAborted,
    HandoffFailed,
    PrefillLink,
    Receiver,
    ReceiverConfig,
)
from pdserve.disagg.sender import Sender
from pdserve.engine.engine import Engine, NoCapacityError, RequestOutput
from pdserve.engine.lockstep import Lockstep
from pdserve.engine.simulated import SimulatedRunner
from pdserve.engine.step_trace import StepTrace, rank_trace_path
from pdserve.model.config import ModelConfig
from pdserve.ops.moe import ExpertRange
from pdserve.ops.moe_ep import ExpertParallelMoE, expert_owner_range
from pdserve.transfer.backend import OnNotification, TransferBackend, open_nixl_backend
from pdserve.transfer.errors import TransferError
from pdserve.transfer.simulated_link import SimulatedLink
from pdserve.wire.client import WorkerClient, WorkerSession
from pdserve.wire.kv_events import KVEvent
from pdserve.wire.protocol import (
    GenerateRequest,
    KVEventBatch,
    PrefillSource,
    RankInfo,
    RankLoad,
    Reservation,
    ReservationQuery,
    TokenEvent,
)
from pdserve.worker.kv_event_log import KVEventLog
from pdserve.worker.rank_config import RankConfig, RankStats
from pdserve.worker.step_loop import StepLoop
from pdserve.worker.warm_up import warm_up

log = logging.getLogger(__name__)
KV_EVENT_WAIT_S = 1.0  # a KV-event subscriber's long poll; well inside the worker edge's call timeout
RESERVE_RETRY_S = 0.02  # a decode rank whose pool is full retries a reservation this often
EVENT_POLL_S = 0.002  # how often a reservation looks whether the steps launched before it have run

OpenBackend = Callable[[str, torch.Tensor, OnNotification], TransferBackend]


async def _completed(event: torch.cuda.Event | None, deadline_s: float) -> None:
    """Waits, without holding the event loop, for the device to pass `event` (None: nothing to wait for)."""
    while event is not None and not event.query():
        if time.monotonic() >= deadline_s:
            raise TimeoutError("the device did not finish the steps launched before a reservation")
        await asyncio.sleep(EVENT_POLL_S)


class _EnginePort:
    """The engine as the hand-off roles reach it: each call runs on the step thread."""

    def __init__(self, runtime: "RankRuntime"):
        self._runtime = runtime
        self._engine = runtime.engine
        # Reservations waiting for room, oldest first, each with the event that wakes it: only the oldest tries, so
        # a long prompt is not passed forever by short ones that fit the pages freed meanwhile.
        self._line: dict[str, asyncio.Event] = {}

    @property
    def waiting_for_room(self) -> int:
        """Reservations waiting for pages: queued work, as the load report counts it."""
        return len(self._line)

    async def reserve(self, request: GenerateRequest) -> list[int]:
        """Pages for the prompt. A full pool or a full batch is a queue, not a failure (pages and sequence slots free
        as running requests end): reservations wait in arrival order, the oldest tried every RESERVE_RETRY_S (on the
        step thread only when the rank's last published figures show room) and the next woken when it leaves, for up
        to the prefill timeout; NoCapacityError after that."""
        deadline_s = time.monotonic() + self._runtime.cfg.prefill_timeout_s
        request_id, woken = request.request_id, asyncio.Event()
        try:
            while True:
                if self._first_in_line(request_id) and self._may_fit(request):
                    try:
                        reserved = await self._runtime.steps.call(lambda: self._engine.reserve(
                            request_id, request.prompt_token_ids, request.sampling))
                    except NoCapacityError:
                        pass
                    else:
                        self._leave_line(request_id)
                        try:
                            await _completed(reserved.settled, deadline_s)
                        except BaseException:  # cancelled or timed out: the pages go back, unseen
                            await self.free(request_id)
                            raise
                        return list(reserved.page_ids)
                if time.monotonic() + RESERVE_RETRY_S >= deadline_s:
                    raise NoCapacityError(f"no room for the prompt's KV pages or a sequence slot within "
                                          f"{self._runtime.cfg.prefill_timeout_s:g} s")
                self._line.setdefault(request_id, woken)
                # The oldest looks for freed pages; the rest sleep until it leaves the line (or time is up).
                wait_s = RESERVE_RETRY_S if self._first_in_line(request_id) else deadline_s - time.monotonic()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), wait_s)
                woken.clear()
        finally:
            self._leave_line(request_id)

    def _first_in_line(self, request_id: str) -> bool:
        return next(iter(self._line), request_id) == request_id

    def _leave_line(self, request_id: str) -> None:
        """Out of the line; the next in it tries at once (it may fit what is left)."""
        if self._line.pop(request_id, None) is not None and self._line:
            next(iter(self._line.values())).set()

    def has_room(self, request: GenerateRequest) -> bool:
        """Room now, with no reservation waiting for it: the prefill may be asked for while the pages are reserved."""
        return not self._line and self._may_fit(request)

    def _may_fit(self, request: GenerateRequest) -> bool:
        """Whether the step thread's last figures leave room for the request (the engine decides): dozens of waiting
        reservations retrying through the step thread would slow every step of a full decode rank."""
        stats = self._runtime.steps.snapshot.engine
        pages = pages_for(len(request.prompt_token_ids), self._engine.cfg.page_size)
        return (stats.held < self._engine.cfg.max_num_seqs
                and stats.free_pages + stats.prefix_cache_pages - stats.growth_pages >= pages)

    async def free(self, request_id: str) -> None:
        await self._runtime.steps.call(lambda: self._engine.abort(request_id))

    abort = free

    def announces(self, request: GenerateRequest, first: TokenEvent) -> bool:
        sampling = request.sampling
        return (not sampling.stop and sampling.grammar is None
                and self._engine.token_ends(sampling, first.token_ids[0], len(request.prompt_token_ids), 1) is None)

    async def start_decoding(self, request_id: str, first: TokenEvent) -> TokenEvent:
        sampled = RequestOutput(request_id, first.token_ids[:1], first.logprobs[:1] if first.logprobs else None,
                                first.top_token_ids, first.top_logprobs)
        output = await self._runtime.steps.call(lambda: self._engine.start_decoding(request_id, sampled))
        event = self._runtime._event(output)
        event.cached_tokens = first.cached_tokens
        # computed by the prefill rank, which had the whole prompt
        event.prompt_logprobs, event.prompt_ranks, event.prompt_top_token_ids, event.prompt_top_logprobs = (
            first.prompt_logprobs, first.prompt_ranks, first.prompt_top_token_ids, first.prompt_top_logprobs)
        return event

    async def add_prefill_only(self, request: GenerateRequest) -> None:
        await self._runtime.steps.call(
            lambda: self._engine.add_prefill_only(request.request_id, request.prompt_token_ids, request.sampling))

    async def release(self, request_id: str) -> None:
        await self._runtime.steps.call(lambda: self._engine.release(request_id))


class RankRuntime:
    def __init__(self, cfg: RankConfig, open_backend: OpenBackend | None = None,
                 prefill_link: Callable[[PrefillSource], PrefillLink] | None = None):
        """`open_backend`, `prefill_link`: the transport and the way to prefill workers (default NIXL and HTTP)."""
        self.cfg = cfg
        self.kv_events = KVEventLog(cfg.rank)
        self._kv_event_arrival = asyncio.Event()  # set on the loop after each record, then replaced
        self._loop: asyncio.AbstractEventLoop | None = None
        self.lockstep: Lockstep | None = None
        if cfg.expert_parallel:
            self.engine, self.lockstep = self._expert_parallel_engine(cfg)
        else:
            self.engine = Engine(cfg.engine, on_kv_events=self._record_kv_events)
        name = f"{cfg.role}-r{cfg.rank}-{uuid.uuid4().hex[:12]}"  # new per start: peers re-learn a restarted rank
        kv = self.engine.runner.kv_cache
        if open_backend is None:
            progress_thread = cfg.nixl_progress_thread
            if progress_thread is None:
                progress_thread = kv.device.type == "cuda"
            self.backend = open_nixl_backend(name, kv, self._on_notification, progress_thread)
        else:
            self.backend = open_backend(name, kv, self._on_notification)
        runner = self.engine.runner
        if isinstance(runner, SimulatedRunner):
            self.backend = SimulatedLink(self.backend, runner.bytes_per_page, runner.seconds_per_page_written)
        self.counters = HandoffCounters()
        self._http = WorkerSession(cfg.internal_token)
        port = self._port = _EnginePort(self)
        self.sender = Sender(cfg.engine.page_size, cfg.transfer_timeout_s, self.backend, port,
                             lambda event: self._emit([event]), self.counters)
        self.receiver = Receiver(
            ReceiverConfig(cfg.rank, cfg.worker_url, cfg.prefill_timeout_s, cfg.transfer_timeout_s, cfg.clock_margin_s),
            self.backend, port,
            prefill_link or (lambda source: WorkerClient(source.url, self._http)), self.counters)
        # Where each running request's events go (`serve`): called on the loop, in order, per event.
        self._streams: dict[str, Callable[[TokenEvent], None]] = {}
        self._joining: dict[str, asyncio.Task] = {}  # hand-offs whose first token went out before the request joined
        self.steps = StepLoop(self.engine, cfg.rank, self.lockstep, self._route_outputs, self._fail_everything)
        self._warm_up_task: asyncio.Future | None = None
        self.warmup_s = 0.0

    def _expert_parallel_engine(self, cfg: RankConfig) -> tuple[Engine, Lockstep]:
        """This rank's experts and the exchange over the default process group (the actor has joined it)."""
        num_experts = ModelConfig.from_dir(cfg.engine.model).n_routed_experts
        experts = ExpertRange(*expert_owner_range(dist.get_rank(), dist.get_world_size(), num_experts))
        # Agreements on host values (who is busy, a step's size) go over gloo: over NCCL each would wait for the
        # device's queued work, and the host could not prepare a step while the last one runs.
        host_group = dist.new_group(backend="gloo") if dist.get_backend() == "nccl" else None
        engine = Engine(cfg.engine, experts, self._record_kv_events,
                        wrap_moe=lambda local: ExpertParallelMoE(
                            None, num_experts, local, capacity_factor=cfg.engine.expert_capacity_factor,
                            host_group=host_group))
        log.info("rank %s of %s: routed experts [%s, %s), %.1f MiB of expert weights", cfg.rank, cfg.world_size,
                 experts.first, experts.first + experts.count, engine.runner.model.routed_expert_bytes() / 2**20)
        return engine, Lockstep(host_group, torch.device("cpu"))

    # --- lifecycle --------------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.steps.start()

    def serve_here(self) -> None:
        """From a caller's first call on: the step thread runs, warm-up is under way, and events go to the caller's
        (running) event loop. Idempotent: every call of the rank's caller makes it."""
        self.start(asyncio.get_running_loop())
        self.start_warm_up()

    def start_warm_up(self) -> None:
        if self._warm_up_task is None:
            self._warm_up_task = asyncio.ensure_future(self._warm_up())

    async def ready(self) -> None:
        """Returns once the rank has warmed up; raises what the warm-up raised."""
        self.start_warm_up()
        assert self._warm_up_task is not None
        await asyncio.shield(self._warm_up_task)

    @property
    def warmed_up(self) -> bool:
        task = self._warm_up_task
        return task is not None and task.done() and not task.cancelled() and task.exception() is None

    def stop(self) -> None:
        self.steps.stop()
        self.backend.close()

    async def close_links(self) -> None:
        """Close the connections to prefill workers, on the rank's event loop (before stop(), where it still runs)."""
        await self._http.close()

    def info(self) -> RankInfo:
        return RankInfo(self.cfg.rank, self.cfg.engine.page_size, self.engine.allocator.num_pages, self.backend.name,
                        self.warmup_s, self.engine.scheduler.cfg.prefill_tokens_beside_decodes)

    def load(self) -> RankLoad:
        snapshot = self.steps.snapshot
        stats = snapshot.engine
        return RankLoad(self.cfg.rank, stats.running, stats.waiting + self._port.waiting_for_room, stats.free_pages,
                        stats.total_pages, stats.prefix_cache_pages, snapshot.steps_completed,
                        time.monotonic() - snapshot.turned_s, not self.warmed_up, stats.queued_prompt_tokens,
                        snapshot.prefill_tokens_per_s, snapshot.decode_step_s if stats.running else 0.0)

    def stats(self) -> RankStats:
        return RankStats(self.steps.snapshot.engine, self.counters.drain())

    # --- requests ---------------------------------------------------------------------------------------------
    async def serve(self, request: GenerateRequest, reservation: Awaitable[Reservation] | None,
                    post: Callable[[TokenEvent], None]) -> None:
        """Runs one request, handing each of its events to `post` as it comes, in order; returns after the event that
        ends it. `reservation`: for a prefill plan, the worker edge's confirm of it with the decode worker, which may
        still be under way: the prompt computes meanwhile, and is written once it is in (or ends if it fails).

        Events go to `post` from `_deliver` itself: a queue and a task per request cost the rank's loop a task
        wake-up per token, 256 a step at a full decode batch (0.75 against 0.09 ms of the loop a step, measured
        alone), all of it holding the GIL the step thread needs."""
        request_id = request.request_id
        if request_id in self._streams:
            post(self._error(request_id, f"request id {request_id!r} is already running on this rank"))
            return
        ended = asyncio.get_running_loop().create_future()
        held: list[TokenEvent] = []  # what the steps made before admission's first event went out

        def forward(event: TokenEvent) -> None:
            if ended.done():
                return
            post(event)
            if event.finish_reason is not None:
                ended.set_result(None)

        self._streams[request_id] = held.append
        try:
            first = await self._admit(request, reservation)
            self._streams[request_id] = forward
            for event in ([first] if first is not None else []) + held:
                forward(event)
            await ended
        finally:
            self._streams.pop(request_id, None)
            await self._end(request_id)

    async def generate(self, request: GenerateRequest,
                       reservation: Awaitable[Reservation] | None = None) -> AsyncGenerator[TokenEvent, None]:
        """`serve` as a stream of events (in-process callers, the warm-up); leaving it early ends the request."""
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        serving = asyncio.ensure_future(self.serve(request, reservation, events.put_nowait))
        try:
            while True:
                event = await events.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            serving.cancel()  # a no-op once it has returned
            with contextlib.suppress(asyncio.CancelledError):
                await serving

    async def _end(self, request_id: str) -> None:
        """The caller went away (or the request finished): free what a hand-off does not own."""
        joining = self._joining.pop(request_id, None)
        if joining is not None:
            joining.cancel()  # the hand-off gives its pages back (the join, if under way, is undone after it)
        if self.sender.holds(request_id):
            await self.sender.abort(request_id)
        elif request_id in self.engine.requests and not self.receiver.holds(request_id):
            await self.steps.call(lambda: self.engine.abort(request_id))

    async def abort(self, request_id: str) -> bool:
        if self.receiver.abort(request_id) or await self.sender.abort(request_id):
            return True  # the hand-off ends the stream
        found = await self.steps.call(lambda: self.engine.abort(request_id))
        post = self._streams.get(request_id)
        if post is not None:
            post(TokenEvent(request_id, [], finish_reason="abort"))
        return found

    async def confirm_reservation(self, query: ReservationQuery) -> Reservation | None:
        return await self.receiver.confirm(query)

    async def _admit(self, request: GenerateRequest, reservation: Awaitable[Reservation] | None) -> TokenEvent | None:
        """Start the request per its plan; returns a first event to emit at once (errors, the decode's first token)."""
        plan, request_id = request.plan, request.request_id
        try:
            if plan.kind == "both":
                await self.steps.call(lambda: self.engine.add_request(request_id, request.prompt_token_ids, request.sampling))
                return None
            if plan.kind == "prefill":
                if reservation is None:
                    return self._error(request_id, "a prefill plan needs a reservation the worker edge confirmed")
                await self.sender.admit(request, asyncio.ensure_future(reservation))
                return None
            if plan.prefill is None:
                return self._error(request_id, "a decode plan needs a prefill source")
            return await self._receive(request)
        except HandoffAborted:
            return TokenEvent(request_id, [], finish_reason="abort")
        except HandoffFailed as error:
            return self._error(request_id, str(error), prefill_failed=True)
        except (ValueError, NoCapacityError, TransferError) as error:  # ValueError: InvalidRequestError
            return self._error(request_id, str(error))
        except Exception as error:  # noqa: BLE001 - a fault of ours ends the stream at once; else its caller waits
            log.exception("request %r could not start", request_id)
            return self._error(request_id, f"the rank could not start the request: {error!r}")

    async def _receive(self, request: GenerateRequest) -> TokenEvent:
        """A decode plan's hand-off. Its first token goes out as soon as the receiver announces it, while the request
        joins the batch (a turn of the step loop); what the join then ends in, other than the tokens that follow,
        comes after it in the stream (`_joined`)."""
        announced: asyncio.Future[TokenEvent] = asyncio.get_running_loop().create_future()
        hand_off = asyncio.ensure_future(self.receiver.receive(request, announce=announced.set_result))
        try:
            await asyncio.wait({hand_off, announced}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            hand_off.cancel()
            raise
        if not announced.done():
            return await hand_off
        self._joining[request.request_id] = hand_off
        hand_off.add_done_callback(lambda done: self._joined(request.request_id, done))
        return announced.result()

    def _joined(self, request_id: str, hand_off: asyncio.Task) -> None:
        self._joining.pop(request_id, None)
        post = self._streams.get(request_id)
        if hand_off.cancelled() or post is None:
            return  # the caller went away (`_end`)
        error = hand_off.exception()
        if isinstance(error, HandoffAborted):
            post(TokenEvent(request_id, [], finish_reason="abort"))
        elif error is not None:
            post(self._error(request_id, f"joining the decode batch failed: {error}"))
        elif (end := hand_off.result().finish_reason) is not None:  # announced only where none was expected
            post(TokenEvent(request_id, [], finish_reason=end))

    async def kv_events_after(self, after: int) -> list[KVEventBatch]:
        """Batches after `after`, waiting up to KV_EVENT_WAIT_S for one when there is none yet (a subscriber's long
        poll: no round trip to the step thread unless a full dump is due)."""
        batches = self.kv_events.newer_than(after)
        if batches is None:
            return await self.steps.call(lambda: self.kv_events.after(after, self.engine.prefix_cache.stored_blocks))
        if not batches:
            arrival = self._kv_event_arrival
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(arrival.wait(), KV_EVENT_WAIT_S)
            batches = self.kv_events.newer_than(after) or []
        return batches

    def _record_kv_events(self, events: list[KVEvent]) -> None:
        self.kv_events.record(events)  # on the step thread
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake_kv_subscribers)

    def _wake_kv_subscribers(self) -> None:
        self._kv_event_arrival.set()
        self._kv_event_arrival = asyncio.Event()  # later waiters wait for the next record

    async def _warm_up(self) -> None:
        started = time.monotonic()
        if self.cfg.warmup:
            await warm_up(self.engine, self.cfg.rank, self.generate)
            self.warmup_s = time.monotonic() - started
            log.info("rank %s warmed up in %.1f s", self.cfg.rank, self.warmup_s)
        self.steps.test_step_delay_s = self.cfg.test_step_delay_s
        if self.cfg.step_trace:  # warm-up's steps (kernels compiling) are no step's cost in service
            self.steps.trace_to(StepTrace(rank_trace_path(self.cfg.step_trace, self.cfg.role, self.cfg.rank)))

    # --- on the step thread -----------------------------------------------------------------------------------
    def _route_outputs(self, outputs: list[RequestOutput]) -> None:
        events: list[TokenEvent] = []
        for output in outputs:
            event = self._event(output)
            request = self.engine.requests.get(output.request_id)
            if output.finish_reason is not None and request is not None and request.keep_pages_on_finish:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self.sender.prefill_done, event, list(request.page_ids))
            else:
                events.append(event)
        self._emit(events)

    def _fail_everything(self, message: str) -> None:
        # Pages a hand-off owns are left to it: a reservation may still be written, a kept prompt still read.
        # (Membership reads of the loop's dicts are safe under the GIL.)
        for request_id in list(self.engine.requests):
            if not (self.receiver.holds(request_id) or self.sender.holds(request_id)):
                self.engine.abort(request_id)
                self._emit([self._error(request_id, message)])
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.sender.fail_computing, message)

    def _emit(self, events: list[TokenEvent]) -> None:
        """Hands a step's events to the event loop in one wake-up: one per token would cost the loop (and the GIL
        the step thread needs) a cross-thread call for every sequence of the batch on every step."""
        if events and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, events)

    def _deliver(self, events: list[TokenEvent]) -> None:
        streams = self._streams
        for event in events:
            post = streams.get(event.request_id)
            if post is not None:
                post(event)

    def _on_notification(self, writer: str, payload: bytes) -> None:
        if self._loop is not None:  # on the transfer thread
            self._loop.call_soon_threadsafe(self.receiver.on_notification, writer, payload)

    # --- events ---------------------------------------------------------------------------------------------
    def _event(self, output: RequestOutput) -> TokenEvent:
        event = TokenEvent(
            request_id=output.request_id, token_ids=output.new_token_ids, text=output.text,
            logprobs=output.new_logprobs, top_token_ids=output.new_top_token_ids, top_logprobs=output.new_top_logprobs,
            finish_reason=output.finish_reason,  # type: ignore[arg-type]
            prompt_tokens=output.prompt_tokens, cached_tokens=output.cached_tokens,
        )
        if output.prompt_logprobs is not None:
            event.prompt_logprobs = [p.logprob if p else None for p in output.prompt_logprobs]
            event.prompt_ranks = [p.rank if p else 0 for p in output.prompt_logprobs]
            event.prompt_top_token_ids = [p.top_token_ids if p else [] for p in output.prompt_logprobs]
            event.prompt_top_logprobs = [p.top_logprobs if p else [] for p in output.prompt_logprobs]
        return event

    @staticmethod
    def _error(request_id: str, message: str, prefill_failed: bool = False) -> TokenEvent:
        return TokenEvent(request_id, [], finish_reason="error", error=message, prefill_failed=prefill_failed)
