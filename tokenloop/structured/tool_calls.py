"""Tool calling: the tools a request offers, the prompt that shows them, the constraint that forces a call,
and the parsers that turn generated text back into tool calls (whole, or streamed as deltas).

The call format is Hermes-style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in the
text (`tool_choice: "auto"`). A forced call is generated as bare JSON under a grammar instead: the named
function's arguments object, or for `"required"` a non-empty array of `{"name", "arguments"}` objects,
so the output always parses into calls whose arguments fit the tool's schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenloop.errors import InvalidRequestError
from tokenloop.structured.spec import StructuredOutputsParams

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN_TAG) + r"\s*(.*?)\s*" + re.escape(CLOSE_TAG), re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolDef:
    """One function the model may call: its name, description and JSON schema of arguments."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """What the request lets the model do with its tools; `name` is set for a named function."""

    mode: ToolMode
    tools: tuple[ToolDef, ...]
    name: str | None = None
    parallel: bool = True


@dataclass(frozen=True)
class ParsedCall:
    """A tool call found in the output: the function name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def parse_tools(tools: Any, param: str = "tools") -> tuple[ToolDef, ...]:
    """Validated tool definitions from OpenAI's `tools` list; raises InvalidRequestError naming the entry."""
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError(f"{param} must be a non-empty list of function tools", param=param)
    out: list[ToolDef] = []
    names: set[str] = set()  # a duplicate is found in O(1): 32,000 tools took a minute with a scan
    for index, tool in enumerate(tools):
        where = f"{param}[{index}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InvalidRequestError(f"{where}: only {{'type': 'function', 'function': {{...}}}} tools are "
                                      "supported", param=where)
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"{where}.function must be an object with a 'name'",
                                      param=f"{where}.function")
        name = function["name"]
        if not _NAME.match(name):
            raise InvalidRequestError(f"{where}.function.name {name!r} must be 1-64 letters, digits, _ . or "
                                      "-", param=f"{where}.function.name")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object",
                                      param=f"{where}.function.parameters")
        if name in names:
            raise InvalidRequestError(f"{where}: duplicate function name {name!r}", param=where)
        names.add(name)
        description = function.get("description")
        out.append(ToolDef(name, description if isinstance(description, str) else None, parameters))
    return tuple(out)


def resolve_tool_choice(tools: Any, tool_choice: Any,
                        parallel_tool_calls: bool | None = None) -> ToolChoice | None:
    """The request's tool mode (None without tools); `tool_choice` without `tools` is a 400, as in OpenAI."""
    if tools is None or tools == []:
        if tool_choice is not None and tool_choice != "none":
            raise InvalidRequestError("tool_choice is only allowed when tools are specified",
                                      param="tool_choice")
        return None
    defs = parse_tools(tools)
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolChoice(tool_choice or "auto", defs, parallel=parallel)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(tool_choice, dict) or tool_choice.get("type") != "function"
            or not isinstance(function, dict) or not isinstance(function.get("name"), str)):
        raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or "
                                  "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if all(t.name != function["name"] for t in defs):
        raise InvalidRequestError(f"tool_choice names function {function['name']!r}, which is not in tools",
                                  param="tool_choice")
    return ToolChoice("named", defs, function["name"], parallel)


def forced_call_constraint(choice: ToolChoice) -> StructuredOutputsParams | None:
    """The grammar a forced call is generated under (None for auto and none)."""
    if choice.mode == "named":
        tool = next(t for t in choice.tools if t.name == choice.name)
        return StructuredOutputsParams(json=tool.parameters, param="tools")
    if choice.mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for t in choice.tools]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls} if len(calls) > 1 else calls[0],
                             "minItems": 1}
    if not choice.parallel:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array, param="tools")


# ---- the prompt ---------------------------------------------------------------------------------------

def template_inputs(messages: list[dict[str, Any]], choice: ToolChoice | None,
                    template: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages and extra template variables for a chat with tools.

    A template that knows tools (it mentions `tools`) gets them as the `tools` variable and the history
    as it is. Otherwise (SmolLM2's template renders only role and content) the tools are described in
    the system message, and earlier calls and results are written into the content as the model should
    write them. `tool_choice: "none"` leaves the tools out of the prompt.
    """
    if choice is None:
        return messages, {}
    offered = [] if choice.mode == "none" else [t.as_openai() for t in choice.tools]
    if template is not None and "tools" in template:
        return messages, {"tools": offered or None}
    rendered = [_render_history(m) for m in messages]
    if offered:
        prompt = _tools_prompt(choice.tools)
        if rendered and rendered[0].get("role") == "system" and isinstance(rendered[0].get("content"), str):
            rendered[0] = {**rendered[0], "content": rendered[0]["content"] + "\n\n" + prompt}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, {}


def _tools_prompt(tools: tuple[ToolDef, ...]) -> str:
    listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return ("You can call functions. Their signatures are listed inside <tools></tools>:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call a function, answer with a JSON object holding its name and arguments inside "
            "<tool_call></tool_call> tags, one block per call:\n"
            f'{OPEN_TAG}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n{CLOSE_TAG}')


def _render_history(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's tool_calls and a tool result, written into content in the call format."""
    role = message.get("role")
    if role == "assistant" and message.get("tool_calls"):
        blocks = []
        for call in message["tool_calls"]:
            function = call.get("function", {}) if isinstance(call, dict) else {}
            arguments = function.get("arguments", "{}")
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except ValueError:
                pass  # shown as the string it is
            body = json.dumps({"name": function.get("name"), "arguments": arguments})
            blocks.append(f"{OPEN_TAG}\n{body}\n{CLOSE_TAG}")
        content = message.get("content") or ""
        return {**message, "content": (content + "\n" if content else "") + "\n".join(blocks)}
    if role == "tool":
        content = message.get("content")
        if isinstance(content, str):
            return {**message, "content": f"<tool_response>\n{content}\n</tool_response>"}
    return message


# ---- parsing the output -------------------------------------------------------------------------------

def _call_from_json(text: str) -> ParsedCall | None:
    try:
        body = json.loads(text)
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    arguments = body.get("arguments", body.get("parameters", {}))
    return ParsedCall(body["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def parse_output(text: str, choice: ToolChoice) -> tuple[str | None, list[ParsedCall]]:
    """(content, tool calls) of a finished generation under `choice`."""
    if choice.mode == "named":
        return None, [ParsedCall(choice.name or "", text)]
    if choice.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []  # cut short by max_tokens: what there is, as text
        calls = [ParsedCall(i["name"], json.dumps(i.get("arguments", {})))
                 for i in items if isinstance(i, dict)]
        return None, calls
    if choice.mode == "none" or OPEN_TAG not in text:
        return text, []
    calls: list[ParsedCall] = []
    pieces: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        call = _call_from_json(match.group(1))
        if call is None:
            continue
        pieces.append(text[last:match.start()])
        calls.append(call)
        last = match.end()
    rest = text[last:]
    if OPEN_TAG in rest:  # a last call the model ended without its closing tag
        head, _, body = rest.partition(OPEN_TAG)
        call = _call_from_json(body.strip())
        if call is not None:
            calls.append(call)
            rest = head
    pieces.append(rest)
    content = "".join(pieces).strip()
    return (content or None), calls
