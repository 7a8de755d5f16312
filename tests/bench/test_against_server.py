"""`bench serve` and `bench policies --base-url` against the real OpenAI server over the tiny model."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bench.conftest import crafted
from tokenloop.bench.cli import main
from tokenloop.bench.trace import dumps_trace
from tokenloop.engine import LLMEngine
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint

serving_api = pytest.importorskip("tokenloop.serving.app")
serving_server = pytest.importorskip("tokenloop.serving.server")


@pytest.fixture(scope="module")
def server_url(tiny_checkpoint: Checkpoint) -> Iterator[str]:
    config = build_engine_config(str(tiny_checkpoint.path), max_num_seqs=8, block_size=4, num_blocks=256,
                                 max_num_batched_tokens=128, policy="priority")
    app = serving_api.create_app(LLMEngine(config, checkpoint=tiny_checkpoint), served_model_name="tiny",
                                 shutdown_timeout_s=2.0)
    with serving_server.ServerThread(app, shutdown_timeout_s=2.0) as thread:
        yield thread.url


def test_serve_gets_exactly_the_asked_output_lengths(server_url: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--base-url", server_url, "--model", "tiny", "--num-prompts", "4", "--random-input-len",
                 "8", "--random-output-len", "5", "--max-concurrency", "2", "--save-result", str(tmp_path / "r.json"),
                 "--disable-tqdm"])
    assert code == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 4 and saved["failed"] == 0
    assert saved["output_lens"] == [5, 5, 5, 5]  # ignore_eos + max_tokens, counted from the server's usage
    assert saved["input_lens"] == [8, 8, 8, 8]
    assert all(len(itls) >= 1 for itls in saved["itls"])


def test_serve_chat_decodes_token_prompts_with_a_local_tokenizer(server_url: str, tiny_model_dir: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--base-url", server_url, "--endpoint", "/v1/chat/completions", "--model", "tiny",
                 "--tokenizer", str(tiny_model_dir), "--num-prompts", "2", "--random-input-len", "6",
                 "--random-output-len", "3", "--disable-tqdm"])
    out = capsys.readouterr().out
    assert code == 0 and "Successful requests:                     2" in out
    assert "Total generated tokens:                  6" in out


def test_policies_against_a_server_replays_the_trace(server_url: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    trace = [crafted(i, i / 50, priority=i % 2, user=f"u{i % 2}", max_tokens=3) for i in range(4)]
    (tmp_path / "t.jsonl").write_text(dumps_trace(trace))
    code = main(["policies", "--trace", str(tmp_path / "t.jsonl"), "--policies", "priority",
                 "--base-url", f"priority={server_url}", "--served-model-name", "tiny",
                 "--report", str(tmp_path / "r.html"), "--disable-tqdm"])
    out = capsys.readouterr().out
    assert code == 0
    assert re.search(r"^Successful requests\s+4$", out, flags=re.M), out
    assert re.search(r"^Failed requests\s+0$", out, flags=re.M)
    assert "<svg" in (tmp_path / "r.html").read_text()
