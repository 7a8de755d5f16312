"""Issue 34, item 3: one request's work is bounded. prompts x n has a cap (`--max-samples-per-request`),
refused before any prompt is tokenized, naming the field that takes it past the cap; a server without
`--max-waiting` (no queue bound to catch it) is what this checks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.serving.conftest import MODEL, LiveServer
from tests.serving.hostile_util import AUTH, assert_error, engine_quiet, keyed_server
from tokenloop.config import ServerLimits
from tokenloop.model.loader import Checkpoint

CAP = 16


@pytest.fixture(scope="module")
def capped(tiny_checkpoint: Checkpoint) -> Iterator[LiveServer]:
    with keyed_server(tiny_checkpoint, max_waiting=None,
                      app_options={"limits": ServerLimits(max_samples_per_request=CAP)}) as live:
        yield live


def _completion(live: LiveServer, **fields: Any) -> Any:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, **fields}
    begin = time.monotonic()
    r = live.client.post("/v1/completions", json=body, headers=AUTH, timeout=30.0)
    return r, time.monotonic() - begin


@pytest.mark.parametrize(("fields", "param"), [
    ({"prompt": ["hi"] * (CAP + 1)}, "prompt"),
    ({"prompt": ["hi"] * 10_000}, "prompt"),
    ({"prompt": [[5, 6]] * 10_000, "stream": True}, "prompt"),
    ({"prompt": ["a", "b", "c", "d"], "n": 5}, "n"),
    ({"n": CAP + 1}, "n"),
])
def test_prompts_times_n_past_the_cap_is_400(capped: LiveServer, fields: dict[str, Any], param: str) -> None:
    r, elapsed = _completion(capped, **fields)
    assert_error(r, 400, param=param)
    assert str(CAP) in r.json()["error"]["message"]
    assert elapsed < 5.0, f"refused only after {elapsed:.1f} s"
    engine_quiet(capped)


def test_prompts_times_n_at_the_cap_is_served(capped: LiveServer) -> None:
    r, _ = _completion(capped, prompt=["a", "b", "c", "d"], n=4)
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["choices"]) == CAP
    engine_quiet(capped)
