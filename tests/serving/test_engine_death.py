"""Process supervision: when the engine thread dies, in-flight requests fail clearly and the server exits
non-zero, so that a supervisor (systemd, Kubernetes, a shell loop) restarts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

from tests.serving.conftest import wait_for_health
from tokenloop.serving.server import free_port

REPO = Path(__file__).resolve().parents[2]

# A real server process whose engine thread dies (a BaseException escapes a step) on its 4th step.
_DRIVER = textwrap.dedent("""
    import sys
    from tokenloop.engine import LLMEngine
    from tokenloop.llm import build_engine_config
    from tokenloop.serving.app import create_app
    from tokenloop.serving.server import serve_forever

    model, port = sys.argv[1], int(sys.argv[2])
    engine = LLMEngine(build_engine_config(model, block_size=4, num_blocks=256))
    real_step = engine.core.step

    def step():
        if engine.num_steps >= 3:
            raise SystemExit("injected: the engine thread dies")
        return real_step()

    engine.core.step = step
    serve_forever(create_app(engine, served_model_name="tiny"), "127.0.0.1", port, log_level="warning")
""")


def test_engine_thread_death_fails_streams_and_exits_non_zero(tiny_model_dir: Path) -> None:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", _DRIVER, str(tiny_model_dir), str(port)], cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, process)
        body = {"model": "tiny", "prompt": "hello world", "max_tokens": 50, "ignore_eos": True, "stream": True}
        began = time.monotonic()
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as response:
            assert response.status_code == 200
            payloads = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
        assert time.monotonic() - began < 5, "the stream did not end promptly"
        assert payloads[-1] == "[DONE]"
        error = json.loads(payloads[-2])["error"]
        assert error["type"] == "server_error" and "engine stopped" in error["message"]
        code = process.wait(timeout=30)
        assert code != 0, "the process must exit non-zero for a supervisor to restart it"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
