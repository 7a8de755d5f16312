"""The OpenAI-compatible API on the tiny model: schemas, streaming, bad input, auth, capacity, failures."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.serving.conftest import MODEL, LiveServer, read_stream, running_server, slow_steps, sse_events
from tokenloop.model.loader import Checkpoint

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0.0}


def assert_usage(usage: dict[str, Any]) -> None:
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def assert_alive(server: LiveServer) -> None:
    """The server still answers after whatever the test did."""
    assert server.client.get("/health").status_code == 200
    r = server.client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- happy paths ----------------------------------------------------------------------------------

def test_models_health_version(server: LiveServer) -> None:
    models = server.client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert set(models["data"][0]) == {"id", "object", "created", "owned_by"}
    assert server.client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert server.client.get("/health").status_code == 200
    assert server.client.get("/version").json()["version"]


def test_completion_schema(server: LiveServer) -> None:
    r = server.client.post("/v1/completions", json={"model": MODEL, "prompt": "hello world", "max_tokens": 5,
                                                   "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and len(body["id"]) == len("cmpl-") + 32
    assert body["object"] == "text_completion"
    assert isinstance(body["created"], int) and abs(body["created"] - time.time()) < 120
    assert body["model"] == MODEL
    (choice,) = body["choices"]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 5
    assert_usage(body["usage"])


def test_completion_stream_frames(server: LiveServer) -> None:
    events = read_stream(server.client, "/v1/completions",
                         {"prompt": "hello world", "max_tokens": 6, "ignore_eos": True, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks and all(isinstance(c, dict) for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "text_completion" and c["model"] == MODEL and "usage" not in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][:-1] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    whole = server.client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 6, "ignore_eos": True,
                                                        "temperature": 0}).json()
    greedy = read_stream(server.client, "/v1/completions", {"prompt": "hello world", "max_tokens": 6,
                                                             "ignore_eos": True, "temperature": 0, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in greedy[:-1]) == whole["choices"][0]["text"]
    assert streamed  # sampled text arrived


def test_completion_stream_include_usage(server: LiveServer) -> None:
    events = read_stream(server.client, "/v1/completions",
                         {"prompt": "hello", "max_tokens": 4, "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    assert_usage(usage_chunk["usage"])


def test_chat_schema(server: LiveServer) -> None:
    r = server.client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_completion_tokens": 5,
                                                        "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion" and body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 5
    assert_usage(body["usage"])


def test_chat_stream_role_first_and_usage(server: LiveServer) -> None:
    events = read_stream(server.client, "/v1/chat/completions",
                         {"messages": CHAT, "max_tokens": 5, "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 5
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    greedy = server.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, "ignore_eos": True,
                                                             "temperature": 0}).json()
    streamed = read_stream(server.client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5,
                                                                   "ignore_eos": True, "temperature": 0,
                                                                   "stream": True})
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed[:-1]) == \
        greedy["choices"][0]["message"]["content"]
    assert isinstance(text, str)


def test_n_2(server: LiveServer) -> None:
    body = server.client.post("/v1/completions", json={"prompt": "hello", "n": 2, "max_tokens": 4,
                                                       "ignore_eos": True, "seed": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 8
    chat = server.client.post("/v1/chat/completions", json={"messages": CHAT, "n": 2, "max_tokens": 4,
                                                           "ignore_eos": True}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    events = read_stream(server.client, "/v1/chat/completions",
                         {"messages": CHAT, "n": 2, "max_tokens": 3, "ignore_eos": True, "stream": True})
    finished = [c["choices"][0]["index"] for c in events[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]
    roles = [c["choices"][0]["index"] for c in events[:-1] if c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]


def test_batched_prompts_and_token_ids(server: LiveServer) -> None:
    ids = server.client.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    greedy = {"n": 2, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    body = server.client.post("/v1/completions", json={"prompt": ["hello world", "the cat"], **greedy}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]  # prompt-major, then sample
    assert body["usage"]["prompt_tokens"] == len(ids) + server.client.post(
        "/tokenize", json={"prompt": "the cat"}).json()["count"]
    as_ids = server.client.post("/v1/completions", json={"prompt": ids, **greedy}).json()
    assert as_ids["choices"][0]["text"] == body["choices"][0]["text"]  # same prompt as text or ids, greedy
    events = read_stream(server.client, "/v1/completions", {"prompt": [ids, ids], "max_tokens": 3,
                                                             "ignore_eos": True, "stream": True})
    assert sorted(c["choices"][0]["index"] for c in events[:-1] if c["choices"][0]["finish_reason"]) == [0, 1]


def test_completion_logprobs_and_echo(server: LiveServer) -> None:
    body = server.client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 4, "logprobs": 3,
                                                       "ignore_eos": True}).json()
    lp = body["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert all(v <= 0 for v in lp["token_logprobs"])
    # Up to 3 alternatives plus the sampled token (keys are token texts, so byte pieces may collide).
    assert all(1 <= len(top) <= 4 and tok in top for tok, top in zip(lp["tokens"], lp["top_logprobs"]))
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0

    echoed = server.client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 2, "echo": True,
                                                         "logprobs": 1, "ignore_eos": True}).json()
    choice = echoed["choices"][0]
    assert choice["text"].startswith("hello world")
    n_prompt = echoed["usage"]["prompt_tokens"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == n_prompt + 2
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None for v in lp["token_logprobs"][1:])  # prompt logprobs even with the prefix cached
    assert "".join(lp["tokens"][:n_prompt]) == "hello world"

    events = read_stream(server.client, "/v1/completions", {"prompt": "hello world", "max_tokens": 3, "echo": True,
                                                             "stream": True, "logprobs": 2, "ignore_eos": True})
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["text"].startswith("hello world")
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == n_prompt + 3


def test_chat_logprobs(server: LiveServer) -> None:
    body = server.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "logprobs": True,
                                                           "top_logprobs": 2, "ignore_eos": True}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
    events = read_stream(server.client, "/v1/chat/completions",
                         {"messages": CHAT, "max_tokens": 4, "logprobs": True, "stream": True, "ignore_eos": True})
    streamed = [e for c in events[:-1] if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert len(streamed) == 4 and all(e["top_logprobs"] == [] for e in streamed)


def test_stop_string_and_seed(server: LiveServer) -> None:
    base = {"prompt": "the quick brown fox", "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    text = server.client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    stop = text[3:6]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    stopped = server.client.post("/v1/completions", json={**base, "stop": [stop]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == text[:text.index(stop)]
    included = server.client.post("/v1/completions", json={**base, "stop": stop,
                                                            "include_stop_str_in_output": True}).json()
    assert included["choices"][0]["text"] == text[:text.index(stop) + len(stop)]

    seeded = {"prompt": "hello", "max_tokens": 8, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    first = server.client.post("/v1/completions", json=seeded).json()["choices"][0]["text"]
    second = server.client.post("/v1/completions", json=seeded).json()["choices"][0]["text"]
    assert first == second


def test_tokenize_detokenize(server: LiveServer) -> None:
    tok = server.client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 1024
    assert server.client.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "hello world"}
    chat = server.client.post("/tokenize", json={"messages": CHAT}).json()
    chat_body = server.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
    assert chat["count"] == chat_body["usage"]["prompt_tokens"]


# ---- bad input ------------------------------------------------------------------------------------

TOO_LONG = "hello world " * 600  # well over the tiny model's 1024 positions

BAD_REQUESTS = [
    ("/v1/completions", {"prompt": TOO_LONG}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}]}, 400, "messages"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 400, "model"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4"}, 400, "model"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": [1]}, 400, "temperature"),
    ("/v1/completions", [1, 2, 3], 400, None),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens[0]"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS,
                         ids=[f"{p}-{param}-{i}" for i, (p, _, _, param) in enumerate(BAD_REQUESTS)])
def test_bad_input(server: LiveServer, path: str, body: Any, status: int, param: str | None) -> None:
    r = server.client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]
    assert_alive(server)


@pytest.mark.parametrize("content", [b"{not json", b"", b'{"prompt": "x",}'])
def test_malformed_json(server: LiveServer, content: bytes) -> None:
    r = server.client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert_alive(server)


def test_unknown_route_is_an_openai_error(server: LiveServer) -> None:
    r = server.client.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


# ---- auth, capacity -------------------------------------------------------------------------------

def test_api_key(tiny_checkpoint: Checkpoint) -> None:
    with running_server(tiny_checkpoint, api_key="sekrit") as live:
        body = {"prompt": "hi", "max_tokens": 1}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = live.client.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert live.client.get("/v1/models").status_code == 401
        ok = {"Authorization": "Bearer sekrit"}
        assert live.client.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert live.client.get("/v1/models", headers=ok).status_code == 200
        assert live.client.get("/health").status_code == 200  # not under /v1


def test_429_past_max_waiting(tiny_checkpoint: Checkpoint) -> None:
    with running_server(tiny_checkpoint, max_num_seqs=1, max_waiting=1) as live, slow_steps(live.async_engine):
        body = {"messages": CHAT, "stream": True, **LONG}
        with live.client.stream("POST", "/v1/chat/completions", json=body) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            next(lines)  # the role chunk: admitted and running
            with live.client.stream("POST", "/v1/chat/completions", json=body) as waiting:
                assert waiting.status_code == 200  # queued: the one waiting slot
                r = live.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
                assert r.status_code == 429, r.text
                assert int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
        live.wait_idle()
        assert live.client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}).status_code == 200


# ---- cancellation ---------------------------------------------------------------------------------

def test_streaming_disconnect_aborts_and_releases_blocks(server: LiveServer) -> None:
    aborted_before = server.metric("tokenloop:request_success_total", finished_reason="abort")
    with slow_steps(server.async_engine), \
            server.client.stream("POST", "/v1/completions", json={"prompt": "hello", "stream": True, **LONG}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.on_engine(lambda e: e.has_unfinished_requests())
    server.wait_idle(timeout_s=5.0)
    assert server.metric("tokenloop:request_success_total", finished_reason="abort") == aborted_before + 1
    assert server.metric("tokenloop:kv_cache_usage_perc") == 0.0
    server.on_engine(lambda e: e.kv_cache.check_invariants([]))
    assert_alive(server)


def test_non_streaming_disconnect_aborts(server: LiveServer) -> None:
    aborted_before = server.metric("tokenloop:request_success_total", finished_reason="abort")
    with slow_steps(server.async_engine), pytest.raises(httpx.TimeoutException):
        server.client.post("/v1/completions", json={"prompt": "hello", **LONG}, timeout=0.5)
    server.wait_idle(timeout_s=5.0)
    assert server.metric("tokenloop:request_success_total", finished_reason="abort") == aborted_before + 1
    assert_alive(server)


# ---- metrics --------------------------------------------------------------------------------------

def test_metrics(server: LiveServer) -> None:
    server.client.post("/v1/completions", json={"prompt": "metrics please", "max_tokens": 3, "ignore_eos": True})
    r = server.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_preempted", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "request_success_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                 "request_prefill_time_seconds_count", "request_decode_time_seconds_count",
                 "iteration_tokens_bucket"):
        assert f"tokenloop:{name}" in text, name
    assert server.metric("tokenloop:request_success_total", finished_reason="length") >= 1
    assert server.metric("tokenloop:generation_tokens_total") >= 3
    assert server.metric("tokenloop:prompt_tokens_total") >= 2
    assert server.metric("tokenloop:e2e_request_latency_seconds_count") >= 1
    assert server.metric("tokenloop:inter_token_latency_seconds_count") >= 2
    assert server.metric("tokenloop:num_requests_running") == 0


# ---- failures -------------------------------------------------------------------------------------

def _fail_once(target: object, name: str) -> None:
    original = getattr(target, name)

    def broken(*args: Any, **kwargs: Any) -> Any:
        setattr(target, name, original)
        raise RuntimeError("injected failure")

    setattr(target, name, broken)


@pytest.mark.parametrize("where", ["forward", "step"])
def test_engine_failure_is_a_500_and_the_next_request_works(server: LiveServer, where: str) -> None:
    body = {"prompt": "hello", "max_tokens": 3, "ignore_eos": True}
    # A forward failing for a batch of one fails that request (a larger batch is bisected to find whose
    # forward fails); a scheduler failure escapes step() and fails the batch.
    target = ("runner", "execute") if where == "forward" else ("scheduler", "schedule")
    server.on_engine(lambda e: _fail_once(getattr(e, target[0]), target[1]))
    r = server.client.post("/v1/completions", json=body)
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "server_error"
    assert_alive(server)
    server.wait_idle()

    server.on_engine(lambda e: _fail_once(getattr(e, target[0]), target[1]))
    events = read_stream(server.client, "/v1/chat/completions", {"messages": CHAT, "stream": True, **body})
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and events[-2]["error"]["type"] == "server_error"
    assert_alive(server)


def test_shutdown_aborts_in_flight_and_joins(tiny_checkpoint: Checkpoint) -> None:
    with running_server(tiny_checkpoint, shutdown_timeout_s=1.0) as live, slow_steps(live.async_engine):
        # 400 tokens at >= 50 ms a step: still running when the 1 s grace ends, however fast the machine.
        stream = live.client.stream("POST", "/v1/completions", json={"prompt": "hello", "stream": True, **LONG})
        response = stream.__enter__()
        lines = response.iter_lines()
        next(lines)
        begin = time.monotonic()
        live.thread.stop()
        assert time.monotonic() - begin < 8.0
        assert not live.async_engine.is_running
        assert not live.engine.has_unfinished_requests()
        assert live.engine.kv_cache.usage == 0.0
        events = list(sse_events(lines))  # past the grace period the stream ends properly, not cut
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "abort"
        stream.__exit__(None, None, None)
