"""A tiny-model server on a background thread (127.0.0.1, free port) and helpers to talk to it."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenloop.engine import LLMEngine
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint, load_checkpoint
from tokenloop.serving.app import create_app
from tokenloop.serving.async_engine import AsyncEngine
from tokenloop.serving.server import ServerThread

MODEL = "tiny"


@dataclass
class LiveServer:
    """A running app: its URL, a client, and the engine behind it."""

    thread: ServerThread
    client: httpx.Client
    engine: LLMEngine
    async_engine: AsyncEngine

    @property
    def url(self) -> str:
        return self.thread.url

    def on_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread (the engine is not thread-safe)."""
        return self.async_engine.call_blocking(fn)

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Until the engine holds no request and no block reference (or fail)."""
        deadline = time.monotonic() + timeout_s
        while True:
            busy, usage = self.async_engine.utility_blocking("idle")
            if not busy and usage == 0.0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle: unfinished={busy}, kv usage={usage}")
            time.sleep(0.02)

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.client.get("/metrics").text, name, **labels)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0 if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        sample, _, label_text = head.partition("{")
        if sample != name:
            continue
        found = dict(part.split("=", 1) for part in label_text.rstrip("}").split(",") if part)
        if all(found.get(k, "").strip('"') == v for k, v in labels.items()):
            return float(value)
    return 0.0


def make_engine(checkpoint: Checkpoint, **options: Any) -> LLMEngine:
    options.setdefault("max_num_seqs", 16)
    options.setdefault("max_num_batched_tokens", 256)
    options.setdefault("block_size", 4)
    options.setdefault("num_blocks", 512)
    return LLMEngine(build_engine_config(str(checkpoint.path), **options), checkpoint=checkpoint)


@contextmanager
def running_server(checkpoint: Checkpoint, *, api_key: str | None = None, shutdown_timeout_s: float = 2.0,
                   **options: Any) -> Iterator[LiveServer]:
    engine = make_engine(checkpoint, **options)
    app = create_app(engine, served_model_name=MODEL, api_key=api_key, shutdown_timeout_s=shutdown_timeout_s)
    with ServerThread(app, shutdown_timeout_s=shutdown_timeout_s) as thread, \
            httpx.Client(base_url=thread.url, timeout=60.0) as client:
        yield LiveServer(thread, client, engine, app.state.async_engine)


# Long enough a pause per step that a request of a few hundred tokens outlasts anything a test does while it
# runs (400 tokens: 20 s), on a machine of any speed; short enough that an abort lands within a step.
SLOW_STEP_S = 0.05


@contextmanager
def slow_steps(async_engine: AsyncEngine, seconds: float = SLOW_STEP_S) -> Iterator[None]:
    """Every engine step first sleeps `seconds` (the core's `inject_step_delay` fault), so a request of N
    tokens stays in flight for at least N x `seconds` however fast the machine is. Not from the event loop."""
    async_engine.utility_blocking("inject_step_delay", seconds)
    try:
        yield
    finally:
        if async_engine.is_running:
            async_engine.utility_blocking("inject_step_delay", 0.0)


def wait_for_health(url: str, process: subprocess.Popen[str], timeout_s: float = 120.0) -> None:
    """Until the server process at `url` answers /health with 200 (fails if it exits or takes too long)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert process.poll() is None, process.stdout.read() if process.stdout else ""
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    """Parse an SSE body: each `data:` payload as JSON, `[DONE]` as the string."""
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        yield payload if payload == "[DONE]" else json.loads(payload)


def read_stream(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any] | str]:
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(sse_events(response.iter_lines()))


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_model_dir: Path) -> Checkpoint:
    return load_checkpoint(str(tiny_model_dir))


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Checkpoint) -> Iterator[LiveServer]:
    with running_server(tiny_checkpoint) as live:
        yield live
