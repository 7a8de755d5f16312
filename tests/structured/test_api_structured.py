"""The API's structured-output and tool fields on the tiny model: response_format, structured_outputs, forced
tool calls through the official `openai` client (streaming and not), and every bad input as a 400."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.serving.conftest import MODEL, LiveServer, read_stream, running_server
from tokenloop.model.loader import Checkpoint

CHAT = [{"role": "user", "content": "Give me a person as JSON."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}


@pytest.fixture(scope="module")
def server(tiny: Checkpoint) -> Iterator[LiveServer]:
    with running_server(tiny) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(server: LiveServer, path: str, body: dict[str, Any]) -> Any:
    return server.client.post(path, json={"model": MODEL, **body})


def test_response_format_json_schema_and_json_object_on_chat_and_completions(server: LiveServer) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for temperature in (0.0, 1.0):
        body = post(server, "/v1/chat/completions", {"messages": CHAT, "response_format": rf, "max_tokens": 40,
                                                     "temperature": temperature, "seed": 3, "n": 2}).json()
        for choice in body["choices"]:
            assert choice["finish_reason"] == "stop", body
            jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    body = post(server, "/v1/completions", {"prompt": "person:", "response_format": rf, "max_tokens": 40,
                                            "temperature": 0.0}).json()
    jsonschema.validate(json.loads(body["choices"][0]["text"]), PERSON)
    body = post(server, "/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"},
                                                 "max_tokens": 30, "temperature": 0.0}).json()
    text = body["choices"][0]["message"]["content"]
    assert text.startswith("{")
    if body["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    streamed = read_stream(server.client, "/v1/chat/completions",
                           {"messages": CHAT, "response_format": rf, "max_tokens": 40, "temperature": 0.0,
                            "stream": True})
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in streamed[:-1] if e["choices"])
    jsonschema.validate(json.loads(text), PERSON)


def test_structured_outputs_regex_choice_grammar(server: LiveServer) -> None:
    body = post(server, "/v1/completions", {"prompt": "id:", "max_tokens": 20, "temperature": 1.0, "n": 3,
                                            "structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}}).json()
    assert all(re.fullmatch("[A-Z]{3}-[0-9]{2}", c["text"]) for c in body["choices"]), body
    body = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 10,
                                                 "structured_outputs": {"choice": ["left", "right"]}}).json()
    assert body["choices"][0]["message"]["content"] in ("left", "right")
    body = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 10, "temperature": 0.0,
                                            "structured_outputs": {"grammar": 'root ::= ("ab" | "cd")+ "."'}}).json()
    choice = body["choices"][0]
    # Cut by max_tokens, the text is still a prefix of a sentence of the grammar.
    assert re.fullmatch(r"(ab|cd)+\." if choice["finish_reason"] == "stop" else r"(ab|cd)*[ac]?", choice["text"])


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}},
     "response_format.json_schema", "missing"),
    ("/v1/completions", {"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "regex"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar",
     "grammar"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ("/v1/completions", {"structured_outputs": {"json": "{nope"}}, "structured_outputs.json", "JSON"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format", "only one"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions", "tools"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call", "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "tools"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "auto"),
    ("/v1/chat/completions", {"tools": [{"type": "retrieval"}]}, "tools[0]", "function"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "tools", "only one"),
])
def test_bad_structured_fields_are_400_naming_the_field(server: LiveServer, path: str, body: dict[str, Any],
                                                        param: str, words: str) -> None:
    base = {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
    r = post(server, path, {**base, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert words in error["message"], error
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_hostile_specs_are_bounded(server: LiveServer) -> None:
    # Nested alternatives (a 2^12-fold grammar), a huge regex repetition, an oversized schema: each is
    # either a 400 or a grammar that answers within the fuel bounds, never a hang.
    nested: dict[str, Any] = {"type": "string"}
    for _ in range(12):
        nested = {"anyOf": [nested, {"type": "array", "items": nested}]}
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}
    for so in ({"json": nested}, {"regex": "(a|b|c){1000}(d|e){1000}" * 20}, {"json": huge}):
        begin = time.monotonic()
        r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "structured_outputs": so})
        assert r.status_code in (200, 400), r.text
        assert time.monotonic() - begin < 30
        if r.status_code == 400:
            assert r.json()["error"]["param"] == f"structured_outputs.{next(iter(so))}"
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "structured_outputs": {"json": huge}})
    assert r.status_code == 400 and "limit" in r.json()["error"]["message"]


def test_named_and_required_tool_calls_through_the_openai_client(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in (named, "required"):
        response = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                                  tool_choice=tool_choice, max_tokens=60, temperature=0.0,
                                                  parallel_tool_calls=False)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls and calls[0].type == "function" and calls[0].id
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if tool_choice is named:
            assert calls[0].function.name == "get_weather"
        # Streaming: the same calls assembled from deltas, as the client's users do.
        stream = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                                tool_choice=tool_choice, max_tokens=60, temperature=0.0,
                                                parallel_tool_calls=False, stream=True)
        assembled: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in stream:
            for c in chunk.choices:
                for delta in c.delta.tool_calls or []:
                    entry = assembled.setdefault(delta.index, {"name": "", "arguments": "", "id": ""})
                    entry["id"] += delta.id or ""
                    entry["name"] += (delta.function.name or "") if delta.function else ""
                    entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
                finish = c.finish_reason or finish
        assert finish == "tool_calls"
        assert [(e["name"], e["arguments"]) for e in assembled.values()] == \
            [(c.function.name, c.function.arguments) for c in calls]
        assert all(e["id"].startswith("call_") for e in assembled.values())


def test_history_with_tool_calls_and_tool_results_renders(client: openai.OpenAI, server: LiveServer) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8,
                                              tool_choice="none")
    assert response.choices[0].message.tool_calls is None
    assert isinstance(response.choices[0].message.content, str)
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8)
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")
