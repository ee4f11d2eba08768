"""Places a worker's DP ranks as Ray actors (a placement group: one GPU per rank on GPU hosts) and talks to them.

Only msgspec-encoded bytes cross into and out of the actors. Token events do not travel one Ray stream item per
token: a rank's events for all its requests go out on one stream (`RankActor.events`), each item what came since
the last, about one per engine step; the worker process sorts them into its requests' queues. At a batch of 256 a
stream per request cost the worker's event loop one Ray item (and a cross-thread wake-up) per token, thousands a
second, which capped what a decode worker could stream below what its GPU made (docs/benchmarks.md).

A prefill plan's reservation follows its request as a second call (`deliver_reservation`): the worker edge confirms
it while the rank computes (pending_reservations.py).
"""

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import AsyncGenerator, Awaitable
from datetime import timedelta
from typing import TYPE_CHECKING

import msgspec
import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.http.ports import free_port
from pdserve.wire.protocol import (
    GenerateRequest,
    KVEventBatch,
    RankInfo,
    RankLoad,
    Reservation,
    ReservationQuery,
    TokenEvent,
)
from pdserve.worker.gc_pauses import freeze_start_up_objects
from pdserve.worker.pending_reservations import PendingReservations
from pdserve.worker.rank_config import RankConfig, RankStats

if TYPE_CHECKING:  # the runtime brings torch, which only the actor's process needs (the worker edge imports this)
    from pdserve.worker.rank_runtime import RankRuntime

log = logging.getLogger(__name__)
RANK_START_TIMEOUT_S = 600.0
MAX_RANK_RESTARTS = 3
PROCESS_GROUP_TIMEOUT_S = 60.0  # a collective waiting longer than this on a peer fails instead of hanging


@ray.remote(max_restarts=MAX_RANK_RESTARTS, max_task_retries=0, max_concurrency=1000)
class RankActor:
    def __init__(self, cfg_json: bytes):
        self._outbox: list[TokenEvent] = []  # events not yet taken by the worker's event stream
        self._outbox_filled = asyncio.Event()
        self._consumer = 0  # the event stream being served; a newer call takes over from an older one
        self._forwarding: set[asyncio.Task] = set()
        self._reservations = PendingReservations()  # what submitted prefill plans wait for
        import torch  # here, in the actor's own process: the worker edge imports this module without torch

        from pdserve.worker.rank_runtime import RankRuntime

        cfg = msgspec.json.decode(cfg_json, type=RankConfig)
        # One intra-op thread, on the GPU too: ranks share the host's cores, and a GPU rank's own tensor work on the
        # host is small (attention plans, step metadata), which a pool of threads per rank only slows: with one pool
        # each, two expert-parallel H200 ranks spent 11 ms of host time a decode step, 3 with one thread
        # (docs/benchmarks.md, "One host thread per GPU rank"). Ray's OMP_NUM_THREADS=1 for actors that ask no CPU
        # does the same unless the environment sets it; this holds either way.
        torch.set_num_threads(1)
        # The transfer thread gets the GIL within this long of asking even while the step thread runs Python (the
        # default 5 ms would add up to 5 ms to every KV write's completion and notification).
        sys.setswitchinterval(cfg.gil_switch_interval_s)
        self.cfg = cfg
        # An expert-parallel rank builds its runtime in join(), once every rank of its instance exists.
        self.runtime: "RankRuntime | None" = None if cfg.expert_parallel else RankRuntime(cfg)

    def _started(self) -> "RankRuntime":
        """The runtime, its step thread running and its warm-up under way (from the first call on)."""
        if self.runtime is None:
            raise RuntimeError(f"rank {self.cfg.rank} has not joined its expert-parallel instance")
        self.runtime.serve_here()
        return self.runtime

    async def rendezvous_address(self) -> str:
        """host:port where this (rank 0) actor's node can host the process group's store."""
        return f"{ray.util.get_node_ip_address()}:{free_port(host='')}"

    async def join(self, address: str) -> None:
        await asyncio.to_thread(self._join, address)

    def _join(self, address: str) -> None:
        import torch.distributed as dist

        from pdserve.engine.engine import resolve_device
        from pdserve.worker.rank_runtime import RankRuntime

        backend = "nccl" if resolve_device(self.cfg.engine.device).type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=self.cfg.rank,
                                world_size=self.cfg.world_size, timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
        self.runtime = RankRuntime(self.cfg)

    async def pid(self) -> int:
        return os.getpid()

    async def info(self) -> bytes:
        """Answers once the rank has warmed up."""
        runtime = self._started()
        await runtime.ready()
        # This process is the rank's own: what start-up made (model, compiled layers, graphs) leaves the collector's
        # sight, so no full collection walks it mid-step (gc_pauses.py).
        frozen = freeze_start_up_objects()
        log.debug("rank %s: %d start-up objects frozen", self.cfg.rank, frozen)
        return msgspec.json.encode(runtime.info())

    async def submit(self, request_json: bytes, reservation_follows: bool = False) -> None:
        """Starts a request; its events come out of `events` with those of every other request. `reservation_follows`:
        a prefill plan, whose reservation `deliver_reservation` brings."""
        request = msgspec.json.decode(request_json, type=GenerateRequest)
        reservation = self._reservations.claim(request.request_id) if reservation_follows else None
        task = asyncio.create_task(self._forward(self._started(), request, reservation))
        self._forwarding.add(task)
        task.add_done_callback(self._forwarding.discard)

    async def deliver_reservation(self, request_id: str, reservation_json: bytes) -> None:
        """The worker edge's confirmed reservation for a prefill plan; null: the edge refused it (the request ends)."""
        self._reservations.deliver(request_id, msgspec.json.decode(reservation_json, type=Reservation | None))

    async def _forward(self, runtime: "RankRuntime", request: GenerateRequest,
                       reservation: asyncio.Future[Reservation] | None) -> None:
        try:
            await runtime.serve(request, reservation, self._post)
        except Exception as error:  # noqa: BLE001 - the request ends with an error event, as any failure does
            self._post(TokenEvent(request.request_id, [], finish_reason="error",
                                  error=f"rank {self.cfg.rank} failed: {error}"))
        finally:
            if reservation is not None:
                self._reservations.drop(request.request_id, reservation)

    def _post(self, event: TokenEvent) -> None:
        self._outbox.append(event)
        self._outbox_filled.set()

    async def events(self):
        """Every request's events, as lists of what came since the previous item."""
        self._consumer += 1
        me = self._consumer
        self._outbox_filled.set()  # an older stream wakes up, sees it is superseded and ends
        while True:
            await self._outbox_filled.wait()
            if me != self._consumer:
                return
            self._outbox_filled.clear()
            if self._outbox:
                events, self._outbox = self._outbox, []
                yield msgspec.json.encode(events)

    async def abort(self, request_id: str) -> bool:
        return await self._started().abort(request_id)

    async def load(self) -> bytes:
        return msgspec.json.encode(self._started().load())

    async def stats(self) -> bytes:
        return msgspec.json.encode(self._started().stats())

    async def confirm_reservation(self, query_json: bytes) -> bytes:
        query = msgspec.json.decode(query_json, type=ReservationQuery)
        return msgspec.json.encode(await self._started().confirm_reservation(query))

    async def kv_events_after(self, after: int) -> bytes:
        return msgspec.json.encode(await self._started().kv_events_after(after))


class RankHandle:
    """The worker process's view of one rank actor: typed calls with timeouts."""

    def __init__(self, rank: int, actor: "ray.actor.ActorHandle"):
        self.rank = rank
        self.actor = actor
        self._streams: dict[str, asyncio.Queue[TokenEvent]] = {}  # the requests in flight on this rank
        self._pump: asyncio.Task | None = None  # reads the rank's event stream into `_streams`
        self._deliveries: set[asyncio.Task] = set()  # reservations on their way to the rank

    async def info(self, timeout_s: float) -> RankInfo:
        return msgspec.json.decode(await asyncio.wait_for(self.actor.info.remote(), timeout_s), type=RankInfo)

    async def generate(self, request: GenerateRequest,
                       reservation: Awaitable[Reservation] | None = None) -> AsyncGenerator[list[TokenEvent], None]:
        """The request's events, as lists of those that arrived while the caller was busy with the previous.
        `reservation`: a prefill plan's, still being confirmed; the rank has the request meanwhile."""
        request_id = request.request_id
        if request_id in self._streams:
            yield [TokenEvent(request_id, [], finish_reason="error",
                              error=f"request id {request_id!r} is already running on this rank")]
            return
        stream: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._streams[request_id] = stream
        finished = False
        try:
            if self._pump is None or self._pump.done():
                self._pump = asyncio.create_task(self._read_events())
            submitted = self.actor.submit.remote(msgspec.json.encode(request), reservation is not None)
            if reservation is not None:  # sent whatever becomes of this call: the rank's prefill waits for it
                delivery = asyncio.ensure_future(self._deliver_reservation(request_id, reservation))
                self._deliveries.add(delivery)
                delivery.add_done_callback(self._deliveries.discard)
            await submitted
            while not finished:
                events = [await stream.get()]
                while not stream.empty():
                    events.append(stream.get_nowait())
                finished = events[-1].finish_reason is not None
                yield events
        finally:
            del self._streams[request_id]
            if not finished:  # the caller went away: the rank stops it (a dead rank's refusal is of no interest)
                self.actor.abort.remote(request_id)

    async def _deliver_reservation(self, request_id: str, reservation: Awaitable[Reservation]) -> None:
        confirm = asyncio.ensure_future(reservation)
        await asyncio.wait({confirm})
        # Refused: the rank only needs to stop (the edge tells the caller why).
        confirmed = None if confirm.cancelled() or confirm.exception() is not None else confirm.result()
        with contextlib.suppress(Exception):  # a dead rank: its event stream ends the request
            await self.actor.deliver_reservation.remote(request_id, msgspec.json.encode(confirmed))

    async def _read_events(self) -> None:
        decoder = msgspec.json.Decoder(list[TokenEvent])
        try:
            async for ref in self.actor.events.options(num_returns="streaming").remote():
                for event in decoder.decode(await ref):
                    stream = self._streams.get(event.request_id)
                    if stream is not None:
                        stream.put_nowait(event)
            message = f"rank {self.rank} ended its event stream"
        except Exception as error:  # noqa: BLE001 - a dead rank ends its requests with an error event
            message = f"rank {self.rank} failed: {error}"
        for request_id, stream in self._streams.items():
            stream.put_nowait(TokenEvent(request_id, [], finish_reason="error", error=message))

    async def abort(self, request_id: str, timeout_s: float) -> bool:
        return await asyncio.wait_for(self.actor.abort.remote(request_id), timeout_s)

    async def load(self, timeout_s: float) -> RankLoad:
        return msgspec.json.decode(await asyncio.wait_for(self.actor.load.remote(), timeout_s), type=RankLoad)

    async def stats(self, timeout_s: float) -> RankStats:
        return msgspec.json.decode(await asyncio.wait_for(self.actor.stats.remote(), timeout_s), type=RankStats)

    async def confirm_reservation(self, query: ReservationQuery, timeout_s: float) -> Reservation | None:
        raw = await asyncio.wait_for(self.actor.confirm_reservation.remote(msgspec.json.encode(query)), timeout_s)
        return msgspec.json.decode(raw, type=Reservation | None)

    async def kv_events_after(self, after: int, timeout_s: float) -> list[KVEventBatch]:
        raw = await asyncio.wait_for(self.actor.kv_events_after.remote(after), timeout_s)
        return msgspec.json.decode(raw, type=list[KVEventBatch])

    async def rendezvous_address(self, timeout_s: float) -> str:
        return await asyncio.wait_for(self.actor.rendezvous_address.remote(), timeout_s)

    async def join(self, address: str, timeout_s: float) -> None:
        await asyncio.wait_for(self.actor.join.remote(address), timeout_s)

    async def pid(self, timeout_s: float) -> int:
        return await asyncio.wait_for(self.actor.pid.remote(), timeout_s)

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)


def _without_token_auth_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def connect_ray(address: str | None) -> None:
    """Joins the Ray at `address` (None: RAY_ADDRESS, else a Ray of this process's own), keeping the caller's SIGINT
    and SIGTERM handlers: a driver's ray.init puts its own in their place, with which SIGTERM exited 15, or aborted
    the process 3 s later with a crash dump (a Ray of its own), and never through the caller's clean-up."""
    if ray.is_initialized():
        return
    main_thread = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    # A Ray of our own has token authentication on (Ray's default, which docs/reliability.md relies on); Ray's notice
    # of it, with how to opt out, is left out of every `pdserve up`. Its other warnings still show.
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_without_token_auth_notice)
    ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False,
             logging_level=logging.WARNING, namespace="pdserve")
    for sig, handler in handlers.items():
        if handler is not None:  # None: set outside Python, nothing to put back
            signal.signal(sig, handler)


def place_ranks(num_ranks: int, gpus_per_rank: float) -> PlacementGroup:
    """A placement group of one bundle per rank, packed (spanning nodes when one cannot hold them all);
    `gpus_per_rank` 0: CPU ranks."""
    bundle = {"GPU": gpus_per_rank} if gpus_per_rank else {"CPU": 0.01}
    group = placement_group([dict(bundle) for _ in range(num_ranks)], strategy="PACK")
    ray.get(group.ready(), timeout=RANK_START_TIMEOUT_S)
    return group


def start_actors(group: PlacementGroup, rank_configs: list[RankConfig], gpus_per_rank: float,
                 max_restarts: int) -> list[RankHandle]:
    handles = []
    for index, cfg in enumerate(rank_configs):
        actor = RankActor.options(
            num_cpus=0 if gpus_per_rank else 0.01, num_gpus=gpus_per_rank, max_restarts=max_restarts,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        ).remote(msgspec.json.encode(cfg))
        handles.append(RankHandle(cfg.rank, actor))
    return handles


def start_ranks(rank_configs: list[RankConfig], gpus_per_rank: float) -> list[RankHandle]:
    """Independent DP ranks: one actor each, which Ray restarts on its own when it dies."""
    group = place_ranks(len(rank_configs), gpus_per_rank)
    return start_actors(group, rank_configs, gpus_per_rank, MAX_RANK_RESTARTS)
