"""`tokenloop trace` on the tiny model: writes a mechanism scenario or a Chrome trace of one request."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.tracing.test_export import check_chrome_trace, check_mechanism_schema
from tokenloop.cli.trace import add_trace_subparser, main


@pytest.mark.parametrize("fmt", ["mechanism", "chrome"])
def test_trace_command(tiny_model_dir: Path, tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / f"trace.{fmt}.json"
    code = main(["trace", "--prompt", "hello world, hello again and again", "--model", str(tiny_model_dir),
                 "--format", fmt, "--out", str(out), "--block-size", "4", "--num-kv-blocks", "64",
                 "--max-tokens", "6", "--concurrent", "2", "--warm-prefix"])
    assert code == 0
    doc = json.loads(out.read_text())
    assert "trace-0" in capsys.readouterr().err
    if fmt == "mechanism":
        check_mechanism_schema(doc)
        steps = doc["scenarios"][0]["steps"]
        assert sum(s["paths"] == ["sample-output"] for s in steps) == 6
        assert "prefix hit tokens" in next(s for s in steps if s["paths"] == ["allocate"])["state"]["artifact"]
        assert "batch of 3 requests" in next(s for s in steps if s["paths"] == ["admit"])["state"]["artifact"]
    else:
        assert sorted(check_chrome_trace(doc).values()) == ["engine loop", "request trace-0"]


def test_subparser_plugs_into_a_parent_parser() -> None:
    parser = argparse.ArgumentParser(prog="tokenloop")
    add_trace_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["trace", "--prompt", "hi", "--format", "mechanism"])
    assert args.command == "trace" and args.format == "mechanism" and callable(args.func)
