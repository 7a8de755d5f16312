"""End to end: a real `python -m tokenloop serve` process on the default model, driven by the `openai` client.

The server is started once for the module on a free 127.0.0.1 port and always terminated with SIGTERM;
a clean shutdown (exit code 0) is part of what is tested. Generations are kept short (max_tokens 16-48)
so the module stays within a few minutes on a 2-core CPU.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import requires_default_model
from tokenloop.serving.server import free_port

pytestmark = [pytest.mark.real_model, pytest.mark.slow, requires_default_model]

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
TOPICS = ["the ocean", "a red bicycle", "mountains", "coffee", "the moon", "a lost key", "rainy days", "a library",
          "jazz music", "a robot", "winter mornings", "a lighthouse", "the desert", "paper airplanes", "a garden",
          "old trains", "fireflies", "a chess game", "volcanoes", "a quiet village", "honeybees", "city lights",
          "a thunderstorm", "a violin", "penguins", "the first snow", "a treasure map", "baking bread",
          "a marathon", "the northern lights", "a clock tower", "kites"]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    port = free_port()
    # float32: served and offline greedy outputs are compared exactly, and only fp32 is batch-invariant
    # (dtype auto switches int4 / bf16 weights with the batch size; tests/model covers its accuracy).
    command = [sys.executable, "-m", "tokenloop", "serve", "--port", str(port), "--max-num-seqs", "64",
               "--shutdown-timeout", "3", "--dtype", "float32"]
    process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                pytest.fail(f"server exited with {process.returncode}:\n{process.stdout.read()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("server did not become healthy within 120 s")
            time.sleep(0.2)
        yield url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                output, _ = process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                output, _ = process.communicate()
                pytest.fail(f"server did not exit within 30 s of SIGTERM:\n{output[-3000:]}")
            assert process.returncode == 0, output[-3000:]


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline_llm():  # tokenloop.LLM
    from tokenloop import LLM

    return LLM(MODEL, dtype="float32")  # as the server: see server_url


def metrics(server_url: str) -> dict[str, float]:
    """Unlabelled view of /metrics: sample name (labels dropped, except finished_reason) -> value."""
    values: dict[str, float] = {}
    for line in httpx.get(server_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        head, value = line.rsplit(" ", 1)
        name = head.split("{", 1)[0]
        if 'finished_reason="' in head:
            name += ":" + head.split('finished_reason="', 1)[1].split('"', 1)[0]
        values[name] = float(value)
    return values


# ---- basic calls ---------------------------------------------------------------------------------

def test_chat_and_completions(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2 + 2?"}],
                                          max_tokens=16, temperature=0)
    assert chat.id.startswith("chatcmpl-") and chat.model == MODEL and chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16,
                                           temperature=0)
    assert completion.id.startswith("cmpl-") and completion.choices[0].text
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage.completion_tokens <= 16
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]

    prompt = "Once upon a time"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    pieces = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text


def test_n_2_and_logprobs(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=16, n=2, temperature=0.8, seed=7, logprobs=True,
                                          top_logprobs=3)
    assert [c.index for c in chat.choices] == [0, 1]
    for choice in chat.choices:
        content = choice.logprobs.content
        assert content and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    completion = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, logprobs=2, temperature=0)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == completion.usage.completion_tokens
    assert "".join(lp.tokens) == completion.choices[0].text


def test_stop_strings(client: openai.OpenAI) -> None:
    prompt = "List the days of the week: Monday, Tuesday,"
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    stop = ","
    assert stop in text, text
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:text.index(stop)]


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=16,
                                         temperature=1.0, seed=seed).choices[0].text

    assert sample(1234) == sample(1234)


# ---- concurrency -----------------------------------------------------------------------------------

def test_32_concurrent_greedy_streams_match_offline(server_url: str, offline_llm) -> None:
    from tokenloop import SamplingParams

    completion_prompts = [f"Write one sentence about {t}." for t in TOPICS[:16]]
    chat_prompts = [[{"role": "user", "content": f"Tell me something about {t}."}] for t in TOPICS[16:]]

    async def stream_all() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=300)

        async def completion(prompt: str) -> str:
            stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                      stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        async def chat(messages: list[dict[str, str]]) -> str:
            stream = await aclient.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                                           temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        try:
            return await asyncio.gather(*[completion(p) for p in completion_prompts], *[chat(m) for m in chat_prompts])
        finally:
            await aclient.close()

    served = asyncio.run(stream_all())
    params = SamplingParams(temperature=0.0, max_tokens=16)
    offline = [o.outputs[0].text for o in offline_llm.generate(completion_prompts, params, use_tqdm=False)]
    offline += [o.outputs[0].text for o in offline_llm.chat(chat_prompts, params, use_tqdm=False)]
    mismatches = [(i, a, b) for i, (a, b) in enumerate(zip(served, offline)) if a != b]
    assert not mismatches, mismatches


def test_dropped_streams_are_aborted_and_release_blocks(server_url: str, client: openai.OpenAI) -> None:
    before = metrics(server_url)
    streams = [client.completions.create(model=MODEL, prompt=f"Tell a long story about {t}.", max_tokens=48,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
               for t in TOPICS[:8]]
    iterators = [iter(s) for s in streams]
    for it in iterators:
        next(it)  # every request is admitted and producing tokens
    assert metrics(server_url)["tokenloop:num_requests_running"] == 8
    for stream in streams[:4]:
        stream.close()  # the client goes away mid-stream
    # A liveness bound, generous for a loaded 2-core machine: the abort counter below tells an abort from a
    # request that ran to its length.
    deadline = time.monotonic() + 15.0
    while metrics(server_url)["tokenloop:num_requests_running"] != 4:
        assert time.monotonic() < deadline, metrics(server_url)
        time.sleep(0.05)
    for it in iterators[4:]:
        reasons = [c.choices[0].finish_reason for c in it if c.choices]
        assert reasons[-1] == "length"
    deadline = time.monotonic() + 15.0
    while True:
        after = metrics(server_url)
        if after["tokenloop:num_requests_running"] == 0 and after["tokenloop:kv_cache_usage_perc"] == 0:
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    aborted = after.get("tokenloop:request_success_total:abort", 0) - before.get(
        "tokenloop:request_success_total:abort", 0)
    assert aborted == 4


def test_bad_requests_get_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=16, temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"
    # Still serving.
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
