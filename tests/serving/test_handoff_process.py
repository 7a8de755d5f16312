"""Handoff across real process boundaries: two engine-core processes, the snapshot through their sockets."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.serving.conftest import SLOW_STEP_S
from tokenloop.core.engine_core import EngineCore
from tokenloop.core.handoff import ImportResult, KVSnapshot
from tokenloop.core.messages import AddRequests, CallResult, CoreRequest, UtilityCall
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint
from tokenloop.request import SamplingParams
from tokenloop.serving.core_client import CoreProcessClient

OPTIONS: dict[str, Any] = {"block_size": 4, "num_blocks": 128, "max_num_batched_tokens": 8}


@pytest.fixture
def two_cores(tiny_model_dir: Path) -> Iterator[tuple[CoreProcessClient, CoreProcessClient]]:
    config = build_engine_config(str(tiny_model_dir), **OPTIONS)
    a, b = CoreProcessClient(config), CoreProcessClient(config)
    yield a, b
    a.close()
    b.close()


def _wait(client: CoreProcessClient, call_id: int, tokens: dict[str, list[int]],
          finished: set[str]) -> CallResult:
    """Collect the client's outputs until the answer to `call_id` arrives."""
    deadline = time.monotonic() + 60
    answer = None
    while answer is None and time.monotonic() < deadline:
        for frame in client.receive():  # every frame, also those after the answer: they carry tokens
            for out in frame.outputs.outputs if frame.outputs is not None else []:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    finished.add(out.request_id)
            answer = next((r for r in frame.results if r.call_id == call_id), answer)
        time.sleep(0.001)
    if answer is not None:
        assert answer.error is None, answer.error
        return answer
    raise AssertionError(f"no answer to call {call_id}")


def test_a_request_moves_between_engine_processes(two_cores: tuple[CoreProcessClient, CoreProcessClient],
                                                  tiny: Checkpoint) -> None:
    a, b = two_cores
    # Slow steps on A: the request is still at it there when the export arrives, however fast the machine.
    params = SamplingParams(temperature=1.0, seed=99, max_tokens=300, ignore_eos=True)
    prompt = tiny.tokenizer.encode("a somewhat longer prompt that spans several blocks of the tiny cache")
    alone = EngineCore(build_engine_config(str(tiny.path), **OPTIONS), checkpoint=tiny)
    alone.add_requests([CoreRequest("r", prompt, params, 0)])
    expected: list[int] = []
    while alone.has_unfinished_requests():
        for out in alone.step().outputs:
            expected.extend(out.new_token_ids)

    tokens_a: dict[str, list[int]] = {}
    tokens_b: dict[str, list[int]] = {}
    done_a: set[str] = set()
    done_b: set[str] = set()
    a.send([UtilityCall(0, "inject_step_delay", [SLOW_STEP_S])])
    _wait(a, 0, tokens_a, done_a)
    a.send([AddRequests(1, [CoreRequest("r", prompt, params, 0)])])
    _wait(a, 1, tokens_a, done_a)
    while len(tokens_a.get("r", [])) < 3:  # let it run a little on A
        a.send([UtilityCall(2, "ping")])
        _wait(a, 2, tokens_a, done_a)
    a.send([UtilityCall(3, "export_request", ["r", [], 30.0])])
    snapshot = _wait(a, 3, tokens_a, done_a).value
    assert isinstance(snapshot, KVSnapshot) and snapshot.blocks
    b.send([UtilityCall(4, "import_request", [snapshot])])
    result = _wait(b, 4, tokens_b, done_b).value
    assert isinstance(result, ImportResult) and result.accepted, result
    a.send([UtilityCall(5, "complete_export", [snapshot.lease_id])])
    assert _wait(a, 5, tokens_a, done_a).value is True
    while "r" not in done_b:
        b.send([UtilityCall(6, "ping")])
        _wait(b, 6, tokens_b, done_b)
    a.send([UtilityCall(7, "kv_facts")])
    facts = _wait(a, 7, tokens_a, done_a).value
    assert facts["unfinished"] == 0 and facts["free_blocks"] == facts["num_blocks"]
    assert "r" not in done_a, "no final output from the source"
    assert tokens_a["r"] + tokens_b["r"] == expected
