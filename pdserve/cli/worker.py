"""`pdserve worker`: one prefill, decode or colocated worker with one or more DP ranks."""

import argparse
import signal
import sys

from pdserve.cli.generate import default_model_dir, require_servable
from pdserve.worker.config import add_worker_arguments, worker_config_from_args


def add_worker_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("worker", help="run one worker (its ranks are Ray actors)")
    add_worker_arguments(parser)
    parser.set_defaults(func=main_worker)


def main_worker(args: argparse.Namespace) -> int:
    from pdserve.worker.process import run_worker

    cfg = worker_config_from_args(args, args.model or str(default_model_dir()))
    require_servable(cfg.engine.model, needs_weights=cfg.engine.reads_weights)
    signal.signal(signal.SIGTERM, stop_starting)  # SIGINT raises KeyboardInterrupt already; serving, uvicorn drains
    try:
        run_worker(cfg)
    except KeyboardInterrupt:
        print("pdserve worker: stopped before it was serving", file=sys.stderr, flush=True)
        return 130
    return 0


def stop_starting(*_: object) -> None:
    """SIGTERM (a pod deleted, `kill`) while the ranks load: stop, and let Ray stop them as their owner exits."""
    raise KeyboardInterrupt
