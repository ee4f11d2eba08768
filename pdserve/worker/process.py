"""Starts a worker: joins (or starts) Ray, places the ranks, waits for their models, then serves HTTP."""

import asyncio
import logging
import time
from pathlib import Path

import ray
import uvicorn

from pdserve.disagg.guard import HandoffGuard
from pdserve.discovery.endpoints import Discovery, FileDiscovery, KubernetesDiscovery, StaticDiscovery
from pdserve.http.slow_clients import KEEP_ALIVE_S, SlowClientLimits, bounded_http
from pdserve.model.config import ModelConfig
from pdserve.wire.client import WorkerClient, WorkerSession
from pdserve.wire.protocol import API_VERSION, RankInfo, Reservation, ReservationQuery, WorkerInfo
from pdserve.worker.config import WorkerConfig
from pdserve.worker.drain import SHUTDOWN_AFTER_DRAIN_S, DrainGate, DrainingServer
from pdserve.worker.gc_pauses import freeze_start_up_objects
from pdserve.worker.http_app import Rank, RankSet, build_worker_app
from pdserve.worker.instance import ExpertParallelInstance
from pdserve.worker.rank_actors import RANK_START_TIMEOUT_S, connect_ray, start_ranks
from pdserve.worker.rank_config import RankConfig

log = logging.getLogger(__name__)
# A prefill worker's reservation query waits while the decode rank waits for room (up to its prefill timeout, the
# same setting as ours), then answers; this much more covers the hops.
CONFIRM_MARGIN_S = 2.0


def run_worker(cfg: WorkerConfig) -> None:
    started = time.monotonic()
    connect_ray(cfg.ray_address)
    on_gpus = ray.cluster_resources().get("GPU", 0) >= cfg.num_ranks * cfg.gpus_per_rank and cfg.engine.device != "cpu"
    gpus_per_rank = cfg.gpus_per_rank if on_gpus else 0.0
    mode = " (one expert-parallel instance)" if cfg.expert_parallel else ""
    print(f"pdserve worker: loading {cfg.engine.model} on {cfg.num_ranks} rank(s){mode} ...", flush=True)
    if cfg.expert_parallel:
        instance = ExpertParallelInstance(rank_configs(cfg), gpus_per_rank)
        handles = asyncio.run(instance.start())
        rank_set = RankSet(handles, restart=instance.restart, stuck_after_s=cfg.stuck_step_timeout_s)
    else:
        handles = start_ranks(rank_configs(cfg), gpus_per_rank)
        rank_set = RankSet(handles, stuck_after_s=cfg.stuck_step_timeout_s)
    info, ready_s = asyncio.run(describe_worker(cfg, handles, started))  # each rank answers once it has warmed up
    gate = DrainGate()
    app = build_worker_app(cfg, rank_set, info, handoff_guard(cfg), gate, ready_s)
    print(f"pdserve worker: {cfg.role} serving on {cfg.url}, ready in {time.monotonic() - started:.1f} s "
          f"(warm-up {max(r.warmup_s for r in info.ranks):.1f} s)", flush=True)
    # No send-stall bound here: the router reads a stream only as fast as its client does, and cuts it (and so
    # this stream) when that client stalls; a bound here would take a slow client for a failed worker.
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                            timeout_graceful_shutdown=SHUTDOWN_AFTER_DRAIN_S, timeout_keep_alive=KEEP_ALIVE_S,
                            http=bounded_http(SlowClientLimits(cfg.request_read_timeout_s)))
    # The edge forwards every stream of the worker, and start-up left ~440k objects (torch, ray, the app) that a full
    # collection would walk with the GIL held: ~190 ms on the 2-core machine (benchmarks/gc_pause.py), a stall of
    # every stream at once. They live as long as the process; keep them out of collections.
    freeze_start_up_objects()
    DrainingServer(config, gate, cfg.drain_timeout_s).run()
    print("pdserve worker: drained, exiting", flush=True)


def rank_configs(cfg: WorkerConfig) -> list[RankConfig]:
    return [
        RankConfig(rank=i, role=cfg.role, engine=cfg.engine, worker_url=cfg.url,
                   transfer_timeout_s=cfg.transfer_timeout_s,
                   prefill_timeout_s=cfg.prefill_timeout_s, world_size=cfg.num_ranks,
                   expert_parallel=cfg.expert_parallel, internal_token=cfg.internal_token,
                   nixl_progress_thread=cfg.nixl_progress_thread,
                   warmup=cfg.warmup, test_step_delay_s=cfg.test_step_delay_s, step_trace=cfg.step_trace,
                   gil_switch_interval_s=cfg.gil_switch_interval_ms / 1e3)
        for i in range(cfg.num_ranks)
    ]


def handoff_guard(cfg: WorkerConfig) -> HandoffGuard:
    peers: Discovery
    if cfg.discovery == "k8s":
        peers = KubernetesDiscovery(cfg.k8s_namespace, cfg.k8s_label_selector)
    elif cfg.discovery == "file":
        peers = FileDiscovery(cfg.peers_file)
    else:
        peers = StaticDiscovery(cfg.peers)
    http = WorkerSession(cfg.internal_token)

    async def confirm_at(url: str, query: ReservationQuery) -> Reservation | None:
        return await WorkerClient(url, http, cfg.prefill_timeout_s + CONFIRM_MARGIN_S).confirm_reservation(query)

    return HandoffGuard(peers, confirm_at, close=http.close)


async def describe_worker(cfg: WorkerConfig, handles: list[Rank], started: float) -> tuple[WorkerInfo, list[float]]:
    """The worker's info, once every rank has warmed up, and per rank the seconds from `started` (monotonic) until
    it had."""
    async def ready(handle: Rank) -> tuple[RankInfo, float]:
        info = await handle.info(RANK_START_TIMEOUT_S)
        return info, time.monotonic() - started

    answers = await asyncio.gather(*(ready(h) for h in handles))
    model_cfg = ModelConfig.from_dir(cfg.engine.model)
    info = WorkerInfo(
        api_version=API_VERSION,
        role=cfg.role,
        model=cfg.served_model_name or Path(cfg.engine.model).name,
        max_model_len=cfg.engine.max_model_len or model_cfg.max_position_embeddings,
        ranks=[info for info, _ in answers],
    )
    return info, [seconds for _, seconds in answers]
