"""`tokenloop serve --replicas 2`: a real server with two engine-core processes behind the router, driven by
the official OpenAI client; its /metrics label every engine series by replica; /admin is behind the key."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import TINY_PROMPTS
from tests.serving.conftest import metric_value, wait_for_health
from tokenloop.serving.server import free_port

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
KEY = "cluster-test-key"


@pytest.fixture(scope="module")
def cluster_url(tiny_model_dir: Path) -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenloop", "serve", "--model", str(tiny_model_dir), "--port", str(port),
         "--host", "127.0.0.1", "--block-size", "4", "--num-kv-blocks", "256", "--replicas", "2",
         "--router", "cost", "--log-level", "warning", "--served-model-name", "tiny"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "TOKENLOOP_API_KEY": KEY},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, process, timeout_s=180)
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            assert process.wait(30) == 0
        finally:
            if process.poll() is None:
                process.kill()


def _admin(url: str, method: str, path: str, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, url + path, headers=headers, timeout=30)


def test_openai_client_streams_through_two_replicas(cluster_url: str) -> None:
    client = openai.OpenAI(base_url=cluster_url + "/v1", api_key=KEY)
    texts = []
    for prompt in TINY_PROMPTS:
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
        texts.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
    again = client.completions.create(model="tiny", prompt=TINY_PROMPTS[0], max_tokens=6, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == texts[0]  # the same greedy text wherever the router put it
    metrics = httpx.get(cluster_url + "/metrics", timeout=10).text
    generated = [metric_value(metrics, "tokenloop:generation_tokens_total", replica=str(i)) for i in (0, 1)]
    assert sum(generated) == 6 * (len(TINY_PROMPTS) + 1)
    assert 'replica="1"' in metrics


def test_admin_routes_need_the_key_and_name_their_errors(cluster_url: str) -> None:
    assert _admin(cluster_url, "GET", "/admin/replicas", key=None).status_code == 401
    status = _admin(cluster_url, "GET", "/admin/replicas").json()
    assert [r["index"] for r in status["replicas"]] == [0, 1]
    assert all(r["alive"] for r in status["replicas"])
    missing = _admin(cluster_url, "POST", "/admin/replicas/5/drain")
    assert missing.status_code == 404 and "0..1" in missing.json()["error"]["message"]
    assert _admin(cluster_url, "POST", "/admin/replicas/abc/drain").status_code == 404
    assert _admin(cluster_url, "POST", "/admin/replicas/0/drain").status_code == 200
    last = _admin(cluster_url, "POST", "/admin/replicas/1/drain")
    assert last.status_code == 409 and "last replica" in last.json()["error"]["message"]
    assert _admin(cluster_url, "POST", "/admin/replicas/0/undrain").json()["admitting"] is True


@pytest.mark.parametrize("flags, message", [
    (["--router", "bogus"], "unknown router 'bogus' (valid: round-robin, least-load, cost)"),
    (["--ray-address", "127.0.0.1:1"], "--ray-address needs --cluster ray"),
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--replicas", "2", "--prefill-replicas", "2"], "leaves no decode replica"),
])
def test_bad_cluster_flags_fail_the_start_with_a_reason(tiny_model_dir: Path, flags: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "tokenloop", "serve", "--model", str(tiny_model_dir),
                           "--port", str(free_port()), *flags], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
