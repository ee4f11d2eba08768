"""The `pdserve` command: one subcommand per process or tool."""

import argparse
import logging
import sys

from pdserve.cli.bench import add_bench_parser
from pdserve.cli.generate import add_generate_parser
from pdserve.cli.make_tiny_model import add_make_tiny_model_parser
from pdserve.cli.planner import add_planner_parser
from pdserve.cli.router import add_router_parser
from pdserve.cli.up import add_up_parser
from pdserve.cli.worker import add_worker_parser
from pdserve.settings.flags import FlagError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default) or ERROR")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(subparsers)
    add_make_tiny_model_parser(subparsers)
    add_worker_parser(subparsers)
    add_router_parser(subparsers)
    add_up_parser(subparsers)
    add_bench_parser(subparsers)
    add_planner_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format='{"ts":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":"%(message)s"}')
    try:
        return args.func(args)
    except FlagError as error:  # as argparse reports a bad flag: one line and exit status 2, no traceback
        parser.exit(2, f"pdserve {args.command}: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
