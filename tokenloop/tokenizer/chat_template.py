"""Chat templates: the sandboxed Jinja environment, message validation, template selection and the
placeholders that keep special-token text in messages plain.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenloop.errors import InvalidRequestError, ModelLoadError


class _GenerationTag(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used by some templates to mark assistant text)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<' and '>', which would corrupt tool schemas in prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def chat_template_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in: sandboxed, trimmed blocks, helpers."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated copies of chat messages: text-part lists joined, None-valued keys dropped."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects",
                                  param="messages")
    chat = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object with 'role' and 'content', "
                                      f"got {type(message).__name__}", param=where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"{where}.role must be a non-empty string", param=f"{where}.role")
        # None-valued keys are dropped, as transformers does, so templates test presence with `is defined`.
        normalized = {key: value for key, value in message.items() if value is not None}
        content = message.get("content")
        if isinstance(content, list):
            normalized["content"] = _join_text_parts(content, f"{where}.content")
        elif content is None and role == "assistant" and message.get("tool_calls"):
            pass  # an assistant turn that only calls tools has no content
        elif not isinstance(content, str):
            raise InvalidRequestError(f"{where}.content must be a string or a list of text parts",
                                      param=f"{where}.content")
        chat.append(normalized)
    return chat


def strings_in(value: Any) -> Iterable[str]:
    """Every string inside nested lists and dicts (message contents, names, tool-call arguments)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _join_text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for index, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}[{index}] must be {{'type': 'text', 'text': <string>}} "
                                      "(only text content is supported)", param=f"{where}[{index}]")
        texts.append(part["text"])
    return "\n".join(texts)  # newline-joined, as vLLM does for multi-part text content


def select_template(default: str | None, named: Mapping[str, str], tools: Any, source: str) -> str:
    """The template a conversation renders with: 'tool_use' when tools are given and it exists, else the
    default; a model without one rejects chat requests."""
    if tools and "tool_use" in named:
        return named["tool_use"]
    if default is not None:
        return default
    raise InvalidRequestError(
        f"{source}: the model has no chat template; send a plain prompt (completions) instead of messages",
        param="messages",
    )


def compile_template(cache: dict[str, jinja2.Template], template_source: str, source: str) -> jinja2.Template:
    """`template_source` compiled once per tokenizer (`cache` is the tokenizer's); `source` names the
    model."""
    template = cache.get(template_source)
    if template is None:
        try:
            template = chat_template_env().from_string(template_source)
        except jinja2.TemplateSyntaxError as exc:
            raise ModelLoadError(f"{source}: chat template does not compile ({exc})") from exc
        cache[template_source] = template
    return template


def mask_special_text(messages: Any, pattern: re.Pattern[str]) -> tuple[Any, list[str], str]:
    """`messages` with each string that spells a special token replaced by a unique placeholder.

    Returns the masked messages, the replaced strings in order, and the regex that splits a rendering at the
    placeholders (its odd pieces are indices into the replaced strings).
    """
    nonce = uuid.uuid4().hex
    literals: list[str] = []

    def mask(value: Any) -> Any:
        if isinstance(value, str) and pattern.search(value):
            literals.append(value)
            return f"\ue000{nonce}:{len(literals) - 1}\ue001"
        if isinstance(value, dict):
            return {k: mask(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mask(v) for v in value]
        return value

    return mask(messages), literals, f"\ue000{nonce}:(\\d+)\ue001"
