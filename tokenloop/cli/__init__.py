"""The `tokenloop` command line: one entry (`tokenloop` / `python -m tokenloop`), one file per subcommand.

main.py parses and dispatches; serve.py, generate.py and trace.py are the commands; options.py holds the
engine flags they share. `bench` lives with the benchmarks (tokenloop/bench/cli.py).
"""

from tokenloop.cli.main import build_parser, main
from tokenloop.cli.options import _engine_options, parse_size  # noqa: F401 - tests/serving/test_cli.py

__all__ = ["build_parser", "main", "parse_size"]
