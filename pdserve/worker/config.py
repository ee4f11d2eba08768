"""A worker's settings, from its command line."""

import argparse
import os
from dataclasses import dataclass, field

from pdserve.engine.config import EngineConfig
from pdserve.http.internal_auth import internal_token_from
from pdserve.wire.protocol import Role


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig
    role: Role = "both"
    num_ranks: int = 1
    expert_parallel: bool = False  # the ranks form one instance sharing the routed experts
    host: str = "127.0.0.1"
    port: int = 8100
    advertise_url: str | None = None  # how peers reach this worker; default http://host:port
    ray_address: str | None = None  # None: start a local Ray instance
    served_model_name: str = ""
    transfer_timeout_s: float = 30.0
    prefill_timeout_s: float = 120.0
    drain_timeout_s: float = 30.0
    gpus_per_rank: float = 1.0  # below 1, workers share a GPU (small models, single-GPU benchmarks)
    request_read_timeout_s: float = 30.0  # a request must arrive whole within this of its first byte (slow clients)
    # The deployment's shared secret: required on every internal-API call, sent on the calls this worker makes.
    internal_token: str = field(default="", repr=False)
    # Hand-off peers: the workers this one exchanges KV with (static URLs, or pods through Kubernetes discovery).
    peers: tuple[str, ...] = ()
    discovery: str = "static"  # static | k8s
    k8s_namespace: str = "default"
    k8s_label_selector: str = "app.kubernetes.io/name=pdserve"
    nixl_progress_thread: bool | None = None  # None: on for GPU pools, off on the CPU
    warmup: bool = True
    stuck_step_timeout_s: float = 300.0  # a rank whose step loop has not turned for this long is unhealthy
    test_step_delay_s: float = 0.0  # test hook: each step after warm-up sleeps this long first

    @property
    def url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face model directory (default: a generated tiny model)")
    parser.add_argument("--role", choices=("prefill", "decode", "both"), default="both")
    parser.add_argument("--ranks", type=int, default=1, help="DP attention ranks in this worker")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="the ranks form one instance: each holds 1/RANKS of the routed experts (DP attention)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--advertise-url", help="URL peers use to reach this worker (default http://HOST:PORT)")
    parser.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one")
    parser.add_argument("--served-model-name", default="")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, help="KV pages per rank (default: from memory settings)")
    parser.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="KV pool per rank on the CPU")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--transfer-timeout-s", type=float, default=30.0, help="bound on one KV write")
    parser.add_argument("--prefill-timeout-s", type=float, default=120.0,
                        help="decode side: bound on waiting for a prefill worker's first token")
    parser.add_argument("--drain-timeout-s", type=float, default=30.0, help="grace period for in-flight requests on SIGTERM")
    parser.add_argument("--gpus-per-rank", type=float, default=1.0,
                        help="GPU share Ray reserves per rank; below 1 several workers share a GPU (set --num-pages then)")
    parser.add_argument("--request-read-timeout-s", type=float, default=30.0,
                        help="a request's head and body must arrive within this of its first byte, else 408")
    parser.add_argument("--load-format", choices=("safetensors", "random"), default="safetensors",
                        help="random: the config's shape with random weights (benchmarks; no checkpoint needed)")
    parser.add_argument("--seed", type=int, default=0, help="seed of random weights and of unseeded sampling")
    parser.add_argument("--internal-token-file", default="",
                        help="file holding the internal-API credential (default: $PDSERVE_INTERNAL_TOKEN, else a "
                             "per-user file shared with a router and workers started on this machine)")
    parser.add_argument("--peers", default="",
                        help="comma-separated URLs of the workers this one may exchange KV with (static discovery)")
    parser.add_argument("--discovery", choices=("static", "k8s"), default="static",
                        help="where hand-off peers come from: --peers, or the pods Kubernetes lists")
    parser.add_argument("--k8s-namespace", default="default")
    parser.add_argument("--k8s-label-selector", default="app.kubernetes.io/name=pdserve")
    parser.add_argument("--nixl-progress-thread", choices=("auto", "on", "off"), default="auto",
                        help="NIXL's own progress thread (spins a core): auto = on for GPU pools, off on the CPU")
    parser.add_argument("--no-warmup", action="store_true",
                        help="report ready without first running every kernel variant once")
    parser.add_argument("--stuck-step-timeout-s", type=float, default=300.0,
                        help="a rank whose step loop has not moved on for this long is unhealthy (a long step is not)")
    parser.add_argument("--test-step-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: slow steps


def worker_config_from_args(args: argparse.Namespace, model_dir: str) -> WorkerConfig:
    engine = EngineConfig(
        model=model_dir, dtype=args.dtype, page_size=args.page_size, num_pages=args.num_pages,
        kv_cache_memory_gib=args.kv_cache_memory_gib, gpu_memory_fraction=args.gpu_memory_fraction,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_cache=not args.no_prefix_cache, progress=False,
        load_format=args.load_format, seed=args.seed,
    )
    return WorkerConfig(
        engine=engine, role=args.role, num_ranks=args.ranks, expert_parallel=args.expert_parallel, host=args.host, port=args.port,
        advertise_url=args.advertise_url, ray_address=args.ray_address, served_model_name=args.served_model_name,
        transfer_timeout_s=args.transfer_timeout_s, prefill_timeout_s=args.prefill_timeout_s,
        drain_timeout_s=args.drain_timeout_s, gpus_per_rank=args.gpus_per_rank,
        request_read_timeout_s=args.request_read_timeout_s,
        internal_token=internal_token_from(args.internal_token_file, os.environ),
        peers=tuple(url.strip() for url in args.peers.split(",") if url.strip()), discovery=args.discovery,
        k8s_namespace=args.k8s_namespace, k8s_label_selector=args.k8s_label_selector,
        nixl_progress_thread={"auto": None, "on": True, "off": False}[args.nixl_progress_thread],
        warmup=not args.no_warmup, stuck_step_timeout_s=args.stuck_step_timeout_s,
        test_step_delay_s=args.test_step_delay_s,
    )
