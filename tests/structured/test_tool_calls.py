"""Tool-call parsing (whole and streamed), tool choice resolution, the forced-call schemas and the prompt."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tokenloop.errors import InvalidRequestError
from tokenloop.structured.tool_calls import (
    ToolChoice,
    forced_call_constraint,
    parse_output,
    resolve_tool_choice,
    template_inputs,
)
from tokenloop.structured.tool_stream import CallPiece, ContentPiece, ToolCallStream

TOOL = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
OTHER = {"type": "function", "function": {"name": "echo"}}
AUTO = resolve_tool_choice([TOOL, OTHER], "auto")
TEXT = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "echo", "arguments": {}}</tool_call>')


def test_auto_output_is_split_into_content_and_calls() -> None:
    content, calls = parse_output(TEXT, AUTO)
    assert content == "Let me add."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("echo", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parse_output("no calls here", AUTO) == ("no calls here", [])
    # An unclosed last call still counts; a block that is not a call stays text.
    content, calls = parse_output('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}', AUTO)
    assert content is None and calls[0].name == "add"
    assert parse_output("<tool_call>oops</tool_call>", AUTO)[1] == []


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_streamed_auto_calls_equal_the_whole_parse(piece: int) -> None:
    stream = ToolCallStream(AUTO)
    events = []
    for i in range(0, len(TEXT), piece):
        events += stream.feed(TEXT[i:i + piece])
    events += stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentPiece))
    calls = [e for e in events if isinstance(e, CallPiece)]
    assert content.strip() == "Let me add."
    assert not any("<tool" in e.text for e in events if isinstance(e, ContentPiece))
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [(0, "add", {"a": 1, "b": 2}),
                                                                            (1, "echo", {})]
    assert stream.num_calls == 2


def test_streamed_named_call_forwards_argument_pieces() -> None:
    named = resolve_tool_choice([TOOL], {"type": "function", "function": {"name": "add"}})
    stream = ToolCallStream(named)
    events = stream.feed('{"a": ') + stream.feed("1, \"b\": 2}") + stream.finish()
    assert events[0].id and events[0].name == "add" and all(e.name is None for e in events[1:])
    assert "".join(e.arguments for e in events) == '{"a": 1, "b": 2}'
    required = resolve_tool_choice([TOOL, OTHER], "required")
    stream = ToolCallStream(required)
    assert stream.feed('[{"name": "echo", "arguments": {}}]') == []
    events = stream.finish()
    assert [(e.index, e.name, e.arguments) for e in events] == [(0, "echo", "{}")]


def test_tool_choice_resolution_and_forced_call_schemas() -> None:
    assert resolve_tool_choice(None, None) is None
    assert resolve_tool_choice(None, "none") is None
    with pytest.raises(InvalidRequestError, match="tools"):
        resolve_tool_choice(None, "auto")
    assert resolve_tool_choice([TOOL], None).mode == "auto"
    named = resolve_tool_choice([TOOL, OTHER], {"type": "function", "function": {"name": "add"}})
    assert named.mode == "named" and named.name == "add"
    assert forced_call_constraint(named).schema == TOOL["function"]["parameters"]
    assert forced_call_constraint(AUTO) is None
    required = forced_call_constraint(resolve_tool_choice([TOOL, OTHER], "required", parallel_tool_calls=False))
    schema = required.schema
    jsonschema.validate([{"name": "add", "arguments": {"a": 1, "b": 2}}], schema)
    for bad in ([], [{"name": "nope", "arguments": {}}], [{"name": "echo", "arguments": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    for tools in ([{"type": "function", "function": {"name": "bad name!"}}], [TOOL, TOOL], "x"):
        with pytest.raises(InvalidRequestError):
            resolve_tool_choice(tools, "auto")


def test_prompt_shows_tools_and_history_in_the_call_format() -> None:
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    messages, extra = template_inputs(history, AUTO, "{{ messages }}")  # a template that knows no tools
    assert extra == {}
    assert messages[0]["content"].startswith("Be brief.") and '"name": "add"' in messages[0]["content"]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' == messages[2]["content"]
    assert messages[3]["content"] == "<tool_response>\n3\n</tool_response>"
    none = ToolChoice("none", AUTO.tools)
    assert "<tools>" not in template_inputs(history, none, "")[0][0]["content"]
    messages, extra = template_inputs(history, AUTO, "{% if tools %}{{ tools }}{% endif %}")
    assert messages is history and [t["function"]["name"] for t in extra["tools"]] == ["add", "echo"]
