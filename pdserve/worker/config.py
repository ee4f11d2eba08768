"""A worker's settings, from its command line."""

import argparse
import os
from dataclasses import dataclass, field
from typing import Literal

from pdserve.engine.config import EngineConfig
from pdserve.http.internal_auth import internal_token_from
from pdserve.settings.flags import add_flags, from_flags, setting
from pdserve.wire.protocol import Role


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig
    role: Role = setting("both", "what this worker's ranks do")
    num_ranks: int = setting(1, "DP attention ranks in this worker", flag="--ranks")
    expert_parallel: bool = setting(False, "the ranks form one instance: each holds 1/RANKS of the routed experts "
                                           "(DP attention)")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8100, "port to listen on")
    channel_port: int = setting(0, "port of the worker channel, where generate streams run (0: one the OS picks; "
                                   "/internal/v1/info tells callers)")
    advertise_url: str | None = setting(None, "URL peers use to reach this worker (default http://HOST:PORT)")
    ray_address: str | None = setting(None, "join this Ray cluster instead of starting a local one")
    served_model_name: str = setting("", "model name reported to the router (default: the model directory's name)")
    transfer_timeout_s: float = setting(30.0, "bound on one KV write")
    prefill_timeout_s: float = setting(120.0, "decode side: bound on waiting for a prefill worker's first token")
    drain_timeout_s: float = setting(30.0, "grace period for in-flight requests on SIGTERM")
    gpus_per_rank: float = setting(1.0, "GPU share Ray reserves per rank; below 1 several workers share a GPU (set "
                                        "--num-pages then)")
    request_read_timeout_s: float = setting(30.0, "a request's head and body must arrive within this of its first "
                                                  "byte, else 408")
    # The deployment's shared secret: required on every internal-API call, sent on the calls this worker makes. From
    # --internal-token-file or the environment, never a flag's value.
    internal_token: str = field(default="", repr=False)
    peers: tuple[str, ...] = setting((), "comma-separated URLs of the workers this one may exchange KV with (static "
                                         "discovery)")
    discovery: Literal["static", "file", "k8s"] = setting("static", "where hand-off peers come from: --peers, "
                                                                    "--peers-file, or the pods Kubernetes lists")
    peers_file: str = setting("", "file of peer URLs, one per line, read again when it changes (file discovery)")
    k8s_namespace: str = setting("default", "namespace whose pods are peers (k8s discovery)")
    k8s_label_selector: str = setting("app.kubernetes.io/name=pdserve", "label selector of peer pods (k8s discovery)")
    nixl_progress_thread: bool | None = setting(None, "NIXL's own progress thread (spins a core): auto = on for GPU "
                                                      "pools, off on the CPU")
    warmup: bool = setting(True, "run every kernel variant once before reporting ready")
    gil_switch_interval_ms: float = setting(
        0.05, "how soon a rank's other threads (KV transfer, event loop) get the GIL from a step thread running Python "
              "(Python's default is 5 ms). Lower makes KV writes complete sooner under load and interrupts the step "
              "thread more often: 0.05 against 0.5 ms wrote KV 1.3-1.4x faster at 20 req/s on two H200s, with TTFT "
              "and ITL no worse (docs/benchmarks.md)")
    stuck_step_timeout_s: float = setting(300.0, "a rank whose step loop has not moved on for this long is unhealthy "
                                                 "(a long step is not)")
    step_trace: str = setting("", "append one JSON line per busy engine step to this file (rank N of a ROLE "
                                  "worker writes FILE.ROLE.rankN): the step's shape and the step loop's turn time, "
                                  "from warm-up's end on (docs/simulation.md)", parse=os.path.abspath)
    test_step_delay_s: float = setting(0.0, "test hook: each step after warm-up sleeps this long first", hidden=True)

    def __post_init__(self) -> None:
        if self.gil_switch_interval_ms <= 0:
            raise ValueError(f"gil_switch_interval_ms must be > 0, got {self.gil_switch_interval_ms}")

    @property
    def url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face model directory (default: a generated tiny model)")
    add_flags(parser, WorkerConfig)
    add_flags(parser, EngineConfig)
    parser.add_argument("--internal-token-file", default="",
                        help="file holding the internal-API credential (default: $PDSERVE_INTERNAL_TOKEN, else a "
                             "per-user file shared with a router and workers started on this machine)")


def worker_config_from_args(args: argparse.Namespace, model_dir: str) -> WorkerConfig:
    engine = from_flags(EngineConfig, args, model=model_dir, progress=False)
    return from_flags(WorkerConfig, args, engine=engine,
                      internal_token=internal_token_from(args.internal_token_file, os.environ))
