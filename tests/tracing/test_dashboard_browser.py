"""The dashboard in headless Chromium, against a live server whose engine is under load.

A background thread owns a tiny-model engine: it keeps submitting requests (aborting some) and stepping.
uvicorn serves the trace router on a free 127.0.0.1 port. Chromium loads /dashboard twice with
--dump-dom (the counters must move, the Gantt must show the submitted requests, the loop diagram must
replay an iteration) and once with --screenshot, which also becomes docs/dashboard.png when that file is
missing or TOKENLOOP_UPDATE_SCREENSHOTS=1.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from tests.tracing.conftest import make_engine
from tokenloop.engine import LLMEngine
from tokenloop.model.loader import Checkpoint
from tokenloop.observe.tracer import Tracer
from tokenloop.request import SamplingParams
from tokenloop.serving.trace_routes import make_trace_router

CHROMIUM = next((path for name in ("chromium", "chromium-browser", "google-chrome")
                 if (path := shutil.which(name)) is not None), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")

REPO = Path(__file__).resolve().parents[2]
WORDS = "the quick brown fox jumps over the lazy dog hello world again and then some more words".split()


class Load(threading.Thread):
    """Owns the engine: submits a request every ~50 ms (every 7th is aborted soon after) and steps."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(name="dashboard-load", daemon=True)
        self.engine = engine
        self.stop = threading.Event()
        self.submitted: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        rng = random.Random(0)
        engine = self.engine
        last_submit = 0.0
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                if now - last_submit > 0.05 and engine.num_unfinished_requests < 12:
                    last_submit = now
                    request_id = f"load-{len(self.submitted)}"
                    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
                    engine.add_request(request_id, prompt, SamplingParams(
                        temperature=0.8, seed=len(self.submitted), max_tokens=rng.randint(10, 60), ignore_eos=True))
                    self.submitted.append(request_id)
                    if len(self.submitted) % 7 == 0:
                        engine.abort_request(self.submitted[-2])
                if engine.has_unfinished_requests():
                    engine.step()
                time.sleep(0.005)  # a slower loop than the tiny model allows: phases wide enough to see
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chromium(profile: Path, *args: str) -> str:
    assert CHROMIUM is not None
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage", f"--user-data-dir={profile}", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def _counter(dom: str, name: str) -> int:
    match = re.search(rf'id="c-{name}" data-value="(\d+)"', dom)
    assert match is not None, f"counter {name} not rendered"
    return int(match.group(1))


def test_dashboard_live_in_chromium(tiny: Checkpoint, tmp_path: Path) -> None:
    engine = make_engine(tiny, Tracer(), num_blocks=96, max_num_seqs=8, max_num_batched_tokens=32)
    app = FastAPI()
    app.include_router(make_trace_router(lambda: engine.tracer))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    server_thread = threading.Thread(target=server.run, name="dashboard-server", daemon=True)
    load = Load(engine)
    server_thread.start()
    load.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started or len(load.submitted) < 10:
            assert time.monotonic() < deadline, "server or load did not start"
            assert load.error is None, load.error
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/dashboard"
        budget = "--virtual-time-budget=3000"  # the page polls every second: a few rounds
        first = _chromium(tmp_path / "profile-1", budget, "--dump-dom", url)
        time.sleep(1.0)
        second = _chromium(tmp_path / "profile-2", budget, "--dump-dom", url)
        shot = tmp_path / "dashboard.png"
        _chromium(tmp_path / "profile-3", budget, "--window-size=1400,1500", "--hide-scrollbars",
                  f"--screenshot={shot}", url)
        assert load.error is None, load.error
    finally:
        load.stop.set()
        load.join(10)
        server.should_exit = True
        server_thread.join(10)

    for dom in (first, second):
        assert 'class="status live"' in dom, "the page never got a state snapshot"
        assert _counter(dom, "steps") > 0
        rows = re.findall(r'class="gantt-row" data-request-id="([^"]+)"', dom)
        assert rows and set(rows) <= set(load.submitted)
        assert re.search(r'class="bar (queue|prefill|decode)"', dom)
        assert re.search(r'class="(node|edge) active"', dom), "the loop diagram replayed no iteration"
        assert re.search(r'id="loop-iter">step #\d+', dom)
    assert _counter(second, "steps") > _counter(first, "steps")
    assert _counter(second, "finished") + _counter(second, "aborted") > 0
    states = re.findall(r'class="gantt-row" data-request-id="[^"]+" data-state="([^"]+)"', second)
    assert {"length"} & set(states), states

    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    # The README's picture: written when missing, refreshed on request (a test run must not dirty the tree).
    picture = REPO / "docs" / "dashboard.png"
    if picture.parent.is_dir() and (not picture.exists() or os.environ.get("TOKENLOOP_UPDATE_SCREENSHOTS") == "1"):
        shutil.copyfile(shot, picture)


def test_dashboard_behind_a_key_asks_for_it(tiny: Checkpoint, tmp_path: Path) -> None:
    """With --api-key the page is served but its data is not: it shows the key form instead."""
    from tokenloop.serving.app import create_app
    from tokenloop.serving.server import ServerThread

    engine = make_engine(tiny, Tracer(), num_blocks=96)
    app = create_app(engine, served_model_name="tiny", api_key="sesame")
    with ServerThread(app) as server:
        dom = _chromium(tmp_path / "profile-key", "--virtual-time-budget=3000", "--dump-dom",
                        server.url + "/dashboard")
        state = httpx.get(server.url + "/v1/dashboard/state", headers={"Authorization": "Bearer sesame"})
    assert 'class="status down"' in dom and "needs its API key" in dom
    assert re.search(r'<form id="key-form" class="key-form">', dom), "the key form stayed hidden"
    assert state.status_code == 200 and "counters" in state.json()  # the key opens the same route
