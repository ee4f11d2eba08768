"""`pdserve worker`: one prefill, decode or colocated worker with one or more DP ranks."""

import argparse

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
    run_worker(cfg)
    return 0
