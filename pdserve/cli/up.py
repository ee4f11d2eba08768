"""`pdserve up`: the router plus prefill and decode workers on this machine, until Ctrl-C."""

import argparse
import signal
import sys
import threading
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
    parser.set_defaults(func=main_up)


def main_up(args: argparse.Namespace) -> int:
    from pdserve.cluster.local import ClusterConfig, LocalCluster

    if args.port and not port_is_free(args.port):
        raise FlagError(f"--port: {args.port} is in use on this machine")
    model = args.model or str(default_model_dir())
    require_servable(model)
    try:
        cfg = ClusterConfig(model=model, port=args.port, num_prefill=args.prefill, num_decode=args.decode,
                            num_both=args.colocated, ranks_per_worker=args.ranks_per_worker, routing=args.routing,
                            log_dir=args.log_dir)
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
