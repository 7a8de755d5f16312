"""Validation at the edge: request bodies are parsed and checked here, before anything reaches the engine.

One check of the parsed JSON enforces what holds for every field of every route: the body is a JSON
object, nested at most `max_depth` deep, every string is valid Unicode (no lone UTF-16 surrogates, which
cannot be encoded as UTF-8 and would break tokenizing, hashing or logging deep inside the loop) and every
number is finite (JSON has no NaN or Infinity; Python's parser accepts them unless told not to).
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tokenloop.config import ServerLimits
from tokenloop.serving.errors import invalid, json_type_name, validation_error

ModelT = TypeVar("ModelT", bound=BaseModel)

JSON_MEDIA_TYPES = ("application/json",)


class _NonFinite:
    """Stands in for NaN / Infinity / a float literal too large for a double, until its path is known."""

    def __init__(self, text: str) -> None:
        self.text = text[:40]


_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,12}")  # ASCII digits only: str.isdigit() also accepts '²'
# A JSON escape of a UTF-16 surrogate: the only way a lone one can get into the parsed body (the UTF-8
# decoder refuses encoded surrogates). Pairs are fine and are joined by the parser; only lone ones fail.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _is_json_media_type(content_type: str | None) -> bool:
    if not content_type:
        return True  # many clients send none; the body still has to be JSON
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type in JSON_MEDIA_TYPES or (media_type.startswith("application/") and media_type.endswith("+json"))


def parse_json_object(body: bytes, content_type: str | None, max_depth: int) -> dict[str, Any]:
    """The request body as a checked JSON object, or an APIError saying what is wrong with it."""
    if not _is_json_media_type(content_type):
        raise invalid(f"Content-Type must be application/json, got {content_type[:100]!r}",
                      code="unsupported_media_type", status=415)
    if not body.strip():
        raise invalid("the request body is empty: send a JSON object", code="invalid_json")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"the request body is not valid UTF-8 (byte {exc.start})", code="invalid_json") from None
    non_finite: list[_NonFinite] = []

    def on_constant(name: str) -> _NonFinite:
        non_finite.append(_NonFinite(name))
        return non_finite[-1]

    def on_float(literal: str) -> float | _NonFinite:
        value = float(literal)
        return value if math.isfinite(value) else on_constant(literal)

    try:
        value = json.loads(text, parse_constant=on_constant, parse_float=on_float)
    except RecursionError:
        raise invalid(f"the request body is nested too deeply (at most {max_depth} levels)",
                      code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, or an integer literal past Python's digit limit
        if "integer string conversion" in str(exc):
            raise invalid(f"the request body holds an integer literal of more than {sys.get_int_max_str_digits()} "
                          "digits", code="invalid_json") from None
        raise invalid(f"the request body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise invalid(f"the request body must be a JSON object, got {json_type_name(value)}")
    # The full walk costs a Python step per value (a million token ids: ~1 s holding the GIL), so it runs
    # only to find the path of a problem the parser or a C-speed scan has already seen.
    if non_finite or _SURROGATE_ESCAPE.search(text) or not _depth_within(value, max_depth):
        check_json_values(value, max_depth)
    return value


def _depth_within(root: dict[str, Any], max_depth: int) -> bool:
    """Whether no container is nested deeper than `max_depth` (visits containers only)."""
    level: list[Any] = [root]
    for _ in range(max_depth):
        children: list[Any] = []
        for container in level:
            items = container.values() if isinstance(container, dict) else container
            children.extend([x for x in items if type(x) is dict or type(x) is list])
        if not children:
            return True
        level = children
    return False


def _join(path: str, key: str | int) -> str:
    """`messages[0].content`; a key that is not a plain name is quoted and cut short (it is the client's
    text: an error message must stay one line and must not echo it back at length)."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if key.isidentifier() and key.isascii() and len(key) <= 64:
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key[:32], ensure_ascii=False)}{'...' if len(key) > 32 else ''}]"


def check_json_values(root: dict[str, Any], max_depth: int) -> None:
    """Depth, valid Unicode in every key and string, finite numbers; iterative, so no recursion limit."""
    stack: list[tuple[Any, str, int]] = [(root, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, dict):
            if depth > max_depth:
                raise invalid(f"the request body is nested too deeply (at most {max_depth} levels)",
                              param=path or None, code="invalid_json")
            for key, item in value.items():
                if not _is_unicode(key):
                    raise invalid(f"{path or 'the request body'} has a key that is not valid Unicode "
                                  "(a lone UTF-16 surrogate)", param=path or None)
                stack.append((item, _join(path, key), depth + 1))
        elif isinstance(value, list):
            if depth > max_depth:
                raise invalid(f"the request body is nested too deeply (at most {max_depth} levels)",
                              param=path or None, code="invalid_json")
            stack.extend((item, _join(path, i), depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            if not _is_unicode(value):
                raise invalid(f"{path} is not valid Unicode: it holds a lone UTF-16 surrogate", param=path)
        elif isinstance(value, _NonFinite):
            raise invalid(f"{path or 'the request body'} must be a finite number, got {value.text} (JSON has "
                          "no NaN or Infinity)", param=path or None)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def validate_body(model: type[ModelT], body: dict[str, Any]) -> ModelT:
    """`model.model_validate(body)`, its errors turned into one clear APIError."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors(include_url=False), model) from None



# ---- the sampling fields every generation route shares ------------------------------------------------

INT32_MAX, INT64_MIN, INT64_MAX, UINT64_MAX = 2 ** 31 - 1, -(2 ** 63), 2 ** 63 - 1, 2 ** 64 - 1
# The sampler holds its parameters as float32: a larger value becomes infinity there.
FLOAT32_MAX = 3.4028234663852886e38
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Names the server passes to the chat template itself: a client may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "add_generation_prompt", "tokenize",
                                      "tools", "documents", "chat_template", "continue_final_message",
                                      "return_dict", "return_assistant_tokens_mask"})


@dataclass(frozen=True)
class EdgeContext:
    """What the edge checks need to know about the server and its model."""

    limits: ServerLimits
    vocab_size: int
    max_model_len: int
    max_waiting: int | None


def check_sampling_fields(req: Any, ctx: EdgeContext, num_prompts: int = 1) -> None:
    """Range and size checks on the fields of `_SamplingFields`, each failure naming its field."""
    limits = ctx.limits
    if not 1 <= req.n <= limits.max_n:
        raise invalid(f"n must be between 1 and {limits.max_n}, got {req.n}", "n")
    samples = req.n * num_prompts
    if samples > limits.max_samples_per_request:
        param = "prompt" if num_prompts > limits.max_samples_per_request else "n"
        raise invalid(f"this request asks for {samples} samples ({num_prompts} prompt(s) x n={req.n}); at most "
                      f"{limits.max_samples_per_request} are allowed per request", param)
    if ctx.max_waiting is not None and samples > ctx.max_waiting:
        raise invalid(f"this request asks for {samples} samples ({num_prompts} prompt(s) x n={req.n}), more "
                      f"than the server's queue can ever hold ({ctx.max_waiting}); lower n", "n")
    if req.seed is not None and not INT64_MIN <= req.seed <= UINT64_MAX:
        raise invalid(f"seed must be a 64-bit integer (between {INT64_MIN} and {UINT64_MAX})", "seed")
    if not INT64_MIN <= req.priority <= INT64_MAX:
        raise invalid(f"priority must be a signed 64-bit integer (between {INT64_MIN} and {INT64_MAX})",
                      "priority")
    if req.top_k is not None and not -1 <= req.top_k <= INT32_MAX:
        raise invalid(f"top_k must be -1 or 0 (disabled) or a positive integer up to {INT32_MAX}, got "
                      f"{req.top_k}", "top_k")
    if not 0 <= req.min_tokens <= ctx.max_model_len:
        raise invalid(f"min_tokens must be between 0 and the context length ({ctx.max_model_len}), got "
                      f"{req.min_tokens}", "min_tokens")
    for name in _FLOAT_FIELDS:
        value = getattr(req, name)
        if value is not None and abs(value) > FLOAT32_MAX:
            raise invalid(f"{name} is out of range: {value:.3g} does not fit a 32-bit float", name)
    if req.user is not None and len(req.user) > limits.max_user_chars:
        raise invalid(f"user may be at most {limits.max_user_chars} characters long, got {len(req.user)}", "user")
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= limits.max_cache_salt_chars:
        raise invalid(f"cache_salt must be a non-empty string of at most {limits.max_cache_salt_chars} characters",
                      "cache_salt")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > limits.max_stop_strings:
        raise invalid(f"stop has {len(stops)} strings; at most {limits.max_stop_strings} are allowed", "stop")
    for i, stop in enumerate(stops):
        param = "stop" if isinstance(req.stop, str) else f"stop[{i}]"
        if not stop:
            raise invalid("stop strings must not be empty", param)
        if len(stop) > limits.max_stop_string_chars:
            raise invalid(f"stop strings may be at most {limits.max_stop_string_chars} characters long, got "
                          f"{len(stop)}", param)
    _check_token_ids(req.stop_token_ids or [], "stop_token_ids", limits.max_stop_token_ids, ctx.vocab_size)
    bias = req.logit_bias or {}
    if len(bias) > limits.max_logit_bias_entries:
        raise invalid(f"logit_bias has {len(bias)} entries; at most {limits.max_logit_bias_entries} are allowed",
                      "logit_bias")
    for key in bias:
        token = int(key) if _TOKEN_ID_KEY.fullmatch(key) else None
        if token is None or not 0 <= token < ctx.vocab_size:
            raise invalid(f"logit_bias keys must be token ids in [0, {ctx.vocab_size}), got {key[:40]!r}",
                          "logit_bias")


def _check_token_ids(ids: list[int], param: str, max_count: int, vocab_size: int) -> None:
    if len(ids) > max_count:
        raise invalid(f"{param} has {len(ids)} entries; at most {max_count} are allowed", param)
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise invalid(f"{param}[{i}] = {token} is not a token id in [0, {vocab_size})", f"{param}[{i}]")


def check_prompt_token_ids(ids: list[int], param: str, vocab_size: int) -> None:
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise invalid(f"{param}[{i}] = {token} is not a token id in [0, {vocab_size})", param)


def check_context(num_prompt_tokens: int, max_tokens: int | None, ctx: EdgeContext, prompt_param: str,
                  max_tokens_param: str) -> None:
    """The prompt, and the prompt plus max_tokens, must fit the context (vLLM's wording)."""
    where = "messages" if prompt_param == "messages" else "prompt"
    if num_prompt_tokens > ctx.max_model_len:
        raise invalid(f"This model's maximum context length is {ctx.max_model_len} tokens. However, your "
                      f"{where} resulted in {num_prompt_tokens} tokens. Please reduce the length of the {where}.",
                      prompt_param)
    if max_tokens is not None and num_prompt_tokens + max_tokens > ctx.max_model_len:
        raise invalid(f"This model's maximum context length is {ctx.max_model_len} tokens. However, you requested "
                      f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {where}, {max_tokens} "
                      f"in the completion). Please reduce the length of the {where} or {max_tokens_param}.",
                      max_tokens_param)


def check_context_lower_bound(min_tokens: int, ctx: EdgeContext, prompt_param: str) -> None:
    """Refuse a prompt whose fewest possible tokens exceed the context, before spending time encoding it."""
    if min_tokens > ctx.max_model_len:
        where = "messages" if prompt_param == "messages" else "prompt"
        raise invalid(f"This model's maximum context length is {ctx.max_model_len} tokens. However, your "
                      f"{where} would result in at least {min_tokens} tokens. Please reduce the length of the "
                      f"{where}.", prompt_param)


def check_messages(messages: list[Any]) -> None:
    """Roles and content shapes of chat messages (tool fields are checked by the tool-calling code)."""
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object with 'role' and 'content', got {json_type_name(message)}", where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            shown = role[:40] if isinstance(role, str) else json_type_name(role)
            raise invalid(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {shown!r}", f"{where}.role")
        content = message.get("content")
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise invalid(f"{where}.content is required", f"{where}.content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise invalid(f"{where}.content[{j}] must be {{\"type\": \"text\", \"text\": <string>}} "
                                  "(only text content is supported)", f"{where}.content[{j}]")
        elif content is not None and not isinstance(content, str):
            raise invalid(f"{where}.content must be a string or a list of text parts, got {json_type_name(content)}",
                          f"{where}.content")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise invalid(f"{where}.name must be a string", f"{where}.name")


def check_tools(tools: list[Any] | None, limits: ServerLimits) -> None:
    """A chat request's tool definitions within their count and size limits (before they are parsed)."""
    if tools is None:
        return
    if len(tools) > limits.max_tools:
        raise invalid(f"tools has {len(tools)} definitions; at most {limits.max_tools} are allowed", "tools")
    size = len(json.dumps(tools, ensure_ascii=False))
    if size > limits.max_tools_bytes:
        raise invalid(f"tools take {size} bytes as JSON; at most {limits.max_tools_bytes} are allowed", "tools")


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS or key.startswith("_"):
            raise invalid(f"chat_template_kwargs may not set {key!r}: the server sets it", "chat_template_kwargs")
