"""End to end: `tokenloop serve --lora a=DIR1 --lora b=DIR2` (a real server process, the tiny fp32 Llama)
answers the official openai client for model "a" and model "b" in one batch with PEFT's tokens; /v1/models
lists the adapters; an unknown adapter is a 404 naming it; run-time load and unload behind the API key."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import write_tiny_llama
from tests.lora_adapters import ALL_TARGETS, peft_greedy, write_peft_adapter
from tests.serving.conftest import metric_value, wait_for_health
from tokenloop.serving.server import free_port

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
KEY = "lora-test-key"
MAX_TOKENS = 6


@dataclass
class LoRAServer:
    url: str
    base_dir: Path
    adapters: dict[str, Path]
    allowed: Path  # --lora-dir


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoRAServer]:
    base = write_tiny_llama(tmp_path_factory.mktemp("lora-e2e-base"), seed=9)
    allowed = tmp_path_factory.mktemp("lora-allowed")
    adapters = {"a": write_peft_adapter(base, allowed / "a", 8, 16, ALL_TARGETS, seed=1),
                "b": write_peft_adapter(base, allowed / "b", 4, 4, ["q_proj", "v_proj", "down_proj"], True,
                                        seed=2)}
    write_peft_adapter(base, allowed / "c", 16, 8, ["o_proj", "up_proj"], seed=3)
    port = free_port()
    # Each step sleeps 20 ms first: requests sent together are in flight together, so they share steps.
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENLOOP_INJECT_STEP_DELAY_S": "0.02",
           "TOKENLOOP_API_KEY": KEY}
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenloop", "serve", "--model", str(base), "--port", str(port), "--dtype",
         "float32", "--block-size", "4", "--num-kv-blocks", "256", "--lora", f"a={adapters['a']}",
         "--lora", f"b={adapters['b']}", "--max-loras", "2", "--lora-dir", str(allowed),
         "--served-model-name", "tiny", "--shutdown-timeout", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, process)
        yield LoRAServer(url, base, adapters, allowed)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


PROMPTS = {"a": [11, 42, 7, 99, 13], "b": [5, 17, 88, 23, 61, 4, 9], "tiny": [11, 42, 7, 99, 13]}


def _expected(server: LoRAServer, model: str, adapter_dir: Path | None) -> str:
    from tokenloop.model.loader import load_checkpoint

    tokens = peft_greedy(server.base_dir, adapter_dir, PROMPTS[model], MAX_TOKENS)
    return load_checkpoint(str(server.base_dir)).tokenizer.decode(tokens)


def test_two_adapters_and_the_base_in_one_batch_equal_peft(lora_server: LoRAServer) -> None:
    client = openai.AsyncOpenAI(base_url=lora_server.url + "/v1", api_key=KEY)

    async def complete(model: str) -> tuple[str, str]:
        response = await client.completions.create(model=model, prompt=PROMPTS[model], max_tokens=MAX_TOKENS,
                                                   temperature=0, extra_body={"ignore_eos": True})
        return response.model, response.choices[0].text

    async def all_at_once() -> list[tuple[str, str]]:
        try:
            return list(await asyncio.gather(complete("a"), complete("b"), complete("tiny")))
        finally:
            await client.close()

    results = asyncio.run(all_at_once())
    expected = [("a", _expected(lora_server, "a", lora_server.adapters["a"])),
                ("b", _expected(lora_server, "b", lora_server.adapters["b"])),
                ("tiny", _expected(lora_server, "tiny", None))]
    assert results == expected
    assert results[0][1] != results[2][1]  # the same prompt: the adapter changed the output
    text = httpx.get(lora_server.url + "/metrics").text
    for name in ("a", "b"):
        assert metric_value(text, "tokenloop:lora_requests_total", lora_adapter=name,
                            finished_reason="length") >= 1


def test_models_lists_adapters_and_unknown_is_404(lora_server: LoRAServer) -> None:
    client = openai.OpenAI(base_url=lora_server.url + "/v1", api_key=KEY)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "a", "b"}
    assert models["a"].parent == "tiny" and models["a"].root == str(lora_server.adapters["a"])
    assert getattr(models["tiny"], "parent", None) is None
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    error = caught.value.body
    assert error["code"] == "model_not_found" and "`nope`" in error["message"] and error["param"] == "model"


def test_load_and_unload_at_run_time(lora_server: LoRAServer) -> None:
    url, headers = lora_server.url, {"Authorization": f"Bearer {KEY}"}
    outside = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert outside.status_code == 401  # behind the key
    refused = httpx.post(url + "/v1/load_lora_adapter", headers=headers,
                         json={"lora_name": "x", "lora_path": str(lora_server.base_dir)})
    assert refused.status_code == 400 and "not under the allowed" in refused.json()["error"]["message"]
    loaded = httpx.post(url + "/v1/load_lora_adapter", headers=headers,
                        json={"lora_name": "c", "lora_path": str(lora_server.allowed / "c")}, timeout=30)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["rank"] == 16
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    text = client.completions.create(model="c", prompt=PROMPTS["a"], max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert text == _expected_for_prompt(lora_server, lora_server.allowed / "c", PROMPTS["a"])
    unloaded = httpx.post(url + "/v1/unload_lora_adapter", headers=headers, json={"lora_name": "c"},
                          timeout=30)
    assert unloaded.status_code == 200 and unloaded.json() == {"lora_name": "c", "failed_requests": 0}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt="hi", max_tokens=2)


def test_unload_fails_in_flight_requests_clearly(lora_server: LoRAServer) -> None:
    url, headers = lora_server.url, {"Authorization": f"Bearer {KEY}"}
    loaded = httpx.post(url + "/v1/load_lora_adapter", headers=headers,
                        json={"lora_name": "d", "lora_path": str(lora_server.allowed / "c")}, timeout=30)
    assert loaded.status_code == 200, loaded.text
    body = {"model": "d", "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", headers=headers, json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))  # it runs (400 steps: >= 8 s)
        assert '"text"' in first
        unloaded = httpx.post(url + "/v1/unload_lora_adapter", headers=headers,
                              json={"lora_name": "d", "wait_s": 0.1}, timeout=30)
        assert unloaded.status_code == 200 and unloaded.json()["failed_requests"] == 1
        rest = "\n".join(lines)
    assert "the LoRA adapter 'd' was unloaded while this request ran" in rest


def _expected_for_prompt(server: LoRAServer, adapter_dir: Path, prompt: list[int]) -> str:
    from tokenloop.model.loader import load_checkpoint

    return load_checkpoint(str(server.base_dir)).tokenizer.decode(peft_greedy(server.base_dir, adapter_dir,
                                                                             prompt, MAX_TOKENS))
