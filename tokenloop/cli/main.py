"""`tokenloop serve | generate | bench | trace | simulate`: the one command line, dispatched to a file per command.

    tokenloop serve --model smollm2-135m-instruct --port 8000 --policy fcfs --max-num-seqs 64
    tokenloop generate "The capital of France is" --max-tokens 32 --temperature 0
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from tokenloop.bench.cli import add_bench_subparser
from tokenloop.cli.generate import add_generate_subparser
from tokenloop.cli.options import LOG_LEVELS
from tokenloop.cli.serve import add_serve_subparser
from tokenloop.cli.simulate import add_simulate_subparser
from tokenloop.cli.trace import add_trace_subparser
from tokenloop.errors import TokenloopError

logger = logging.getLogger("tokenloop")


def build_parser() -> argparse.ArgumentParser:
    """The `tokenloop` parser: global flags, then one subcommand per file of this package."""
    parser = argparse.ArgumentParser(prog="tokenloop", description="A small LLM serving engine.")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_serve_subparser(commands)
    add_generate_subparser(commands)
    add_bench_subparser(commands)
    add_trace_subparser(commands)
    add_simulate_subparser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status (2: a configuration or model error, 130: interrupted)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except TokenloopError as exc:  # configuration or model problems: a message, not a traceback
        logger.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
