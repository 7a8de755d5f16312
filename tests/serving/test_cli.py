"""The command line: size parsing, options, `generate`, and `serve` as a real process with signals."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.serving.conftest import wait_for_health
from tokenloop.cli import _engine_options, build_parser, parse_size
from tokenloop.serving.server import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("text", "size"), [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
                                            ("1000000", 1_000_000), ("64 kib", 65536)])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "2XB", "-1GiB", "0"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_serve_defaults_bind_localhost() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.api_key is None
    assert _engine_options(args) == {"policy": "fcfs"}


def test_serve_options_map_to_engine_options() -> None:
    args = build_parser().parse_args(["serve", "--policy", "sjf", "--max-num-seqs", "8", "--max-num-batched-tokens",
                                      "128", "--kv-cache-memory", "512MiB", "--max-waiting", "3",
                                      "--max-model-len", "256", "--no-prefix-caching", "--device", "cuda"])
    assert _engine_options(args) == {"policy": "sjf", "max_num_seqs": 8, "max_num_batched_tokens": 128,
                                     "kv_cache_memory_bytes": 512 * 2**20, "max_waiting": 3, "max_model_len": 256,
                                     "enable_prefix_caching": False, "device": "cuda"}
    with pytest.raises(SystemExit):  # blocks or bytes, not both
        build_parser().parse_args(["serve", "--num-kv-blocks", "10", "--kv-cache-memory", "1GiB"])


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_generate_prints_text(tiny_model_dir: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "tokenloop", "generate", "hello world", "--model",
                             str(tiny_model_dir), "--max-tokens", "5", "--temperature", "0"],
                            capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "finish_reason=length" in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_process_exits_0_on_signal(tiny_model_dir: Path, sig: signal.Signals) -> None:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tokenloop", "serve", "--model", str(tiny_model_dir),
                                "--port", str(port), "--num-kv-blocks", "64", "--block-size", "4",
                                "--shutdown-timeout", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, process)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["model"] == str(tiny_model_dir)
        process.send_signal(sig)
        output, _ = process.communicate(timeout=30)
        assert process.returncode == 0, output
        assert "shut down cleanly" in output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
