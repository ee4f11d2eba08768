"""`pdserve up`: the router plus prefill and decode workers on this machine, until Ctrl-C."""

import argparse
import shlex
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.cli.generate import default_model_dir, require_servable
from pdserve.http.ports import port_is_free
from pdserve.settings.flags import FlagError

if TYPE_CHECKING:
    from pdserve.cluster.local import LocalCluster


def add_up_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("up", help="start a local cluster: router + prefill + decode workers")
    parser.add_argument("--model", help="Hugging Face model directory (default: a generated tiny model)")
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument("--colocated", type=int, default=0, help="workers with role both (prefill + decode)")
    parser.add_argument("--ranks-per-worker", type=int, default=1)
    parser.add_argument("--routing", choices=("prefix", "round_robin", "least_load"), default="prefix")
    parser.add_argument("--log-dir", help="where each process writes its log (default: a temp dir)")
    parser.add_argument("--worker-args", default="", help="more `pdserve worker` flags for every worker, as one "
                                                          "string, e.g. \"--num-pages 512 --host-kv-cache-gib 1\"")
    parser.add_argument("--router-args", default="", help="more `pdserve router` flags, as one string")
    parser.set_defaults(func=main_up)


# Flags `pdserve up` sets itself for each process: given again, they would break the cluster's wiring.
WORKER_FLAGS_OWNED = {"--model", "--role", "--ranks", "--peers", "--discovery", "--peers-file", "--host", "--port",
                      "--ray-address"}
ROUTER_FLAGS_OWNED = {"--model", "--workers", "--discovery", "--workers-file", "--routing", "--host", "--port"}


def checked_flags(option: str, text: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                  build_config: Callable[[argparse.Namespace], object], owned: set[str],
                  required: list[str]) -> tuple[str, ...]:
    """The flags of `text`, parsed and turned into their process's configuration here, so that a bad one is a usage
    error before anything starts rather than a process that dies at start."""
    flags = shlex.split(text)
    if taken := [flag for flag in flags if flag.split("=")[0] in owned]:
        raise FlagError(f"{option}: {', '.join(taken)} is set by pdserve up (use its own flags)")
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_arguments(parser)
    try:
        args, unknown = parser.parse_known_args([*required, *flags])
        if not unknown:
            build_config(args)
    except (argparse.ArgumentError, ValueError) as error:
        raise FlagError(f"{option}: {error}") from None
    if unknown:
        raise FlagError(f"{option}: unknown flag(s) {' '.join(unknown)}")
    return tuple(flags)


def main_up(args: argparse.Namespace) -> int:
    from pdserve.cluster.local import ClusterConfig, LocalCluster

    if args.port and not port_is_free(args.port):
        raise FlagError(f"--port: {args.port} is in use on this machine")
    model = args.model or str(default_model_dir())
    require_servable(model)
    from pdserve.worker.config import add_worker_arguments, worker_config_from_args
    from pdserve_router.config import add_router_arguments, router_config_from_args

    worker_args = checked_flags("--worker-args", args.worker_args, add_worker_arguments,
                                lambda parsed: worker_config_from_args(parsed, model), WORKER_FLAGS_OWNED,
                                ["--role", "prefill"])
    router_args = checked_flags("--router-args", args.router_args, add_router_arguments, router_config_from_args,
                                ROUTER_FLAGS_OWNED, ["--model", model, "--workers", "http://127.0.0.1:1"])
    try:
        cfg = ClusterConfig(model=model, port=args.port, num_prefill=args.prefill, num_decode=args.decode,
                            num_both=args.colocated, ranks_per_worker=args.ranks_per_worker, routing=args.routing,
                            log_dir=args.log_dir, worker_args=worker_args, router_args=router_args)
    except ValueError as error:
        raise FlagError(str(error)) from None
    started, stop = threading.Event(), threading.Event()

    def on_signal(*_: object) -> None:
        if not started.is_set():
            raise KeyboardInterrupt  # stop starting: what has started is stopped on the way out
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    print(f"pdserve up: starting {args.prefill} prefill + {args.decode} decode + {args.colocated} colocated "
          f"worker(s) on {model} ...", flush=True)
    try:
        with LocalCluster(cfg) as cluster:
            started.set()
            serve_until(stop, cluster, model)
    except (RuntimeError, TimeoutError) as error:  # a process that did not come up: its log says why, no traceback
        print(f"pdserve up: error: {error}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("pdserve up: stopped before the cluster was up", file=sys.stderr, flush=True)
        return 130
    return 0


def serve_until(stop: threading.Event, cluster: "LocalCluster", model: str) -> None:
    """Say where everything is, then wait for Ctrl-C."""
    print(f"router:  {cluster.url}   (OpenAI API: {cluster.url}/v1, metrics: {cluster.url}/metrics)")
    for worker in cluster.workers:
        print(f"{worker.name + ':':8} {worker.url}   (metrics: {worker.url}/metrics, log: {worker.log_path})")
    print("try:  curl -s " + cluster.url + "/v1/completions -H 'content-type: application/json' "
          "-d '{\"model\": \"" + cluster_model_name(model) + "\", \"prompt\": \"The quick brown fox\", "
          "\"max_tokens\": 16}'", flush=True)
    print("Ctrl-C stops everything.", flush=True)
    stop.wait()
    print("pdserve up: stopping ...", flush=True)


def cluster_model_name(model_dir: str) -> str:
    from pathlib import Path

    return Path(model_dir).name
