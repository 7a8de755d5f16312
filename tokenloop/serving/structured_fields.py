"""The API's structured-output and tool fields: request fields -> one `StructuredOutputsParams`, and the
response messages that carry tool calls.

Request side: OpenAI's `response_format` (text, json_object, json_schema), vLLM's `structured_outputs`
(json, regex, choice, grammar), and `tools` / `tool_choice` (a forced call is a JSON constraint). The
deprecated `functions` / `function_call` are refused with a pointer to `tools`. Every refusal is an
`InvalidRequestError` naming the field, which the server answers with a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_serializer

from tokenloop.errors import InvalidRequestError
from tokenloop.request import FinishReason
from tokenloop.structured.spec import StructuredOutputsParams
from tokenloop.structured.tool_calls import ToolChoice, forced_call_constraint, parse_output, resolve_tool_choice
from tokenloop.structured.tool_stream import ContentPiece, StreamEvent, ToolCallStream


def response_format_spec(response_format: Any) -> StructuredOutputsParams | None:
    """OpenAI's `response_format` as a constraint (None for `{"type": "text"}` or no field)."""
    param = "response_format"
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise InvalidRequestError("response_format must be an object", param=param)
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, param=param)
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, dict):
            raise InvalidRequestError("response_format.json_schema must be an object with a 'schema'",
                                      param="response_format.json_schema")
        schema = body.get("schema", body.get("json_schema"))
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format.json_schema.schema must be a JSON schema object",
                                      param="response_format.json_schema.schema")
        return StructuredOutputsParams(json=schema, param="response_format.json_schema")
    raise InvalidRequestError(f"response_format type {kind!r} is not supported (use text, json_object or "
                              "json_schema)", param="response_format.type")


def refuse_deprecated_functions(body: Any) -> None:
    """`functions` and `function_call` were replaced by `tools` and `tool_choice`: say so."""
    if getattr(body, "functions", None) is not None:
        raise InvalidRequestError("functions is deprecated and not supported: send the functions as "
                                  "tools=[{'type': 'function', 'function': {...}}] instead",
                                  param="functions")
    if getattr(body, "function_call", None) is not None:
        raise InvalidRequestError("function_call is deprecated and not supported: use tool_choice with tools "
                                  "instead", param="function_call")


def tool_choice_of(body: Any) -> ToolChoice | None:
    """The chat request's tool mode, or None when it offers no tools."""
    refuse_deprecated_functions(body)
    return resolve_tool_choice(getattr(body, "tools", None), getattr(body, "tool_choice", None),
                               getattr(body, "parallel_tool_calls", None))


def structured_outputs_of(body: Any, choice: ToolChoice | None = None) -> StructuredOutputsParams | None:
    """The one constraint a completions or chat request asks for, from whichever field asked for it
    (`choice`: the request's tool mode, when the caller has parsed its tools already)."""
    specs: list[StructuredOutputsParams] = []
    raw = getattr(body, "structured_outputs", None)
    if raw is not None:
        specs.append(StructuredOutputsParams.from_dict(raw))
    from_format = response_format_spec(getattr(body, "response_format", None))
    if from_format is not None:
        specs.append(from_format)
    if choice is None and hasattr(body, "tools"):
        choice = tool_choice_of(body)
    forced = forced_call_constraint(choice) if choice is not None else None
    if forced is not None:
        specs.append(forced)
    if len(specs) > 1:
        names = " and ".join(s.param for s in specs)
        raise InvalidRequestError(f"{names} each constrain the output; send only one", param=specs[-1].param)
    return specs[0] if specs else None


# ---- response messages --------------------------------------------------------------------------------

class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionCall(_Message):
    name: str
    arguments: str


class ToolCall(_Message):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Message):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(_Message):
    """A streamed piece of a tool call: id, type and name come with its first piece only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


# ---- from generated text to the message ----------------------------------------------------------------

def final_message(text: str, finish_reason: str | None,
                  choice: ToolChoice | None) -> tuple[str | None, list[ToolCall] | None, str | None]:
    """(content, tool_calls, finish_reason) of a finished choice; a normal end with calls is "tool_calls"."""
    if choice is None or choice.mode == "none":
        return text, None, finish_reason
    content, calls = parse_output(text, choice)
    if not calls:
        return text, None, finish_reason
    tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
    return content, tool_calls, "tool_calls" if finish_reason == FinishReason.STOP else finish_reason


def stream_deltas(events: list[StreamEvent]) -> list[dict[str, Any]]:
    """Keyword arguments of one DeltaMessage per stream event (content, or one tool-call piece)."""
    out: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, ContentPiece):
            out.append({"content": event.text})
        else:
            function = DeltaFunctionCall(name=event.name, arguments=event.arguments)
            call = DeltaToolCall(index=event.index, id=event.id, type="function" if event.id else None,
                                 function=function)
            out.append({"tool_calls": [call]})
    return out


def stream_finish_reason(stream: ToolCallStream | None, finish_reason: str | None) -> str | None:
    """A streamed choice that made calls and ended normally ends with "tool_calls"."""
    if stream is not None and stream.num_calls and finish_reason == FinishReason.STOP:
        return "tool_calls"
    return finish_reason
