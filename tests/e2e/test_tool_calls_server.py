"""End to end: tool calls and JSON schemas from a real `python -m tokenloop serve` on the default model, through
the official `openai` client, streaming and not."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tests.conftest import requires_default_model
from tests.e2e.test_openai_server import MODEL, server_url  # noqa: F401 - the module's server fixture

pytestmark = [pytest.mark.real_model, pytest.mark.slow, requires_default_model]

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 30}},
                   "required": ["query"], "additionalProperties": False}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "search": SEARCH["function"]["parameters"]}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(server_url: str) -> Any:  # noqa: F811
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def streamed_calls(stream: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, ["", ""])
                entry[0] += (delta.function.name or "") if delta.function else ""
                entry[1] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    return content, [tuple(v) for _, v in sorted(calls.items())], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                         "auto"])
def test_tool_calls_parse_and_validate_streaming_and_not(client: Any, tool_choice: Any) -> None:
    options = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, SEARCH], tool_choice=tool_choice,
                   max_tokens=60, temperature=0.0, parallel_tool_calls=False)
    response = client.chat.completions.create(**options)
    choice = response.choices[0]
    calls = choice.message.tool_calls or []
    if tool_choice != "auto":
        assert choice.finish_reason == "tool_calls" and len(calls) == 1, choice
    if calls:
        assert choice.finish_reason == "tool_calls"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if isinstance(tool_choice, dict):
        assert calls[0].function.name == "get_weather"
    content, streamed, finish = streamed_calls(client.chat.completions.create(**options, stream=True))
    assert streamed == [(c.function.name, c.function.arguments) for c in calls]
    assert finish == choice.finish_reason
    assert content.strip() == (choice.message.content or "").strip()


def test_json_schema_response_format(client: Any) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a big city and its population, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
        max_tokens=40, temperature=0.0)
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"$ref": "#/$defs/nowhere"}}})
    assert info.value.body["param"] == "response_format.json_schema"
