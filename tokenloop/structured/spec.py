"""What a request constrains its output to: a JSON schema, JSON mode, a regex, a choice or a grammar.

`StructuredOutputsParams` is vLLM's `structured_outputs` (json, regex, choice, grammar, json_object); OpenAI's
`response_format` and forced tool calls are translated into it at the edge. It is a plain frozen
dataclass (it travels inside `SamplingParams`, to the engine core too), and `key()` names the grammar it
compiles to. A JSON schema is held as its JSON text: what crosses a process boundary or reaches the grammar
compiler is a bounded string, never an arbitrary decoded object (an integer past 64 bits made msgpack raise
in the engine's thread).

The checks here are the cheap, structural ones (size, nesting, integer range); what only compiling can
tell (time, the compiler's own limits) is checked by `tokenloop.structured.compile_worker` at the door.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from tokenloop.errors import InvalidRequestError

# The vLLM field names, in the order a spec is checked.
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# A spec's JSON text may be at most this long: grammars grow with it, and so does compile time.
MAX_SPEC_BYTES = 256 * 1024
# Nesting of a JSON schema, counting each `$ref` followed as one more level. The grammar compiler recurses
# natively over it: a chain of ~1,000 nested `$ref`s crashed it (SIGSEGV); 300 compiled in 0.15 s.
MAX_SCHEMA_DEPTH = 128
_INT64 = 1 << 63


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint on the output text.

    `json`: a JSON schema (a dict or its JSON text; held as compact JSON text, keys in their given order,
    which is the order the output writes them). `regex`: a regular expression the whole output
    matches. `choice`: the output is one of these strings. `grammar`: an EBNF grammar (GBNF as llama.cpp
    writes it, or Lark). `json_object`: any JSON object (OpenAI's JSON mode). `param` names the request
    field the spec came from; `field` is the one an error in the constraint itself names.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError(f"{self.param}.choice must be a list of strings", param=self.param)
            if not self.choice:
                raise InvalidRequestError(f"{self.param}.choice must not be empty", param=self.param)
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"{self.param} must set exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}", param=self.param)
        field = self.field
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{field} must be a non-empty string", param=field)
            if isinstance(value, str) and len(value) > MAX_SPEC_BYTES:  # chars: bytes are at least as many
                raise InvalidRequestError(f"{field} is longer than the limit of {MAX_SPEC_BYTES} bytes",
                                          param=field)
        if self.choice is not None and _encoded_size_exceeds(list(self.choice), MAX_SPEC_BYTES):
            raise InvalidRequestError(f"{field} is larger than the limit of {MAX_SPEC_BYTES} bytes in all",
                                      param=field)
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json, field))

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def field(self) -> str:
        """The request field an error in the constraint names: `structured_outputs.regex`, or the field the
        spec was translated from (`response_format.json_schema`, `tools`)."""
        if self.param != "structured_outputs":
            return self.param
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        return f"{self.param}.{given[0]}" if len(given) == 1 else self.param

    @property
    def schema(self) -> Any:
        """The JSON schema, decoded (None for the other kinds)."""
        return None if self.json is None else json.loads(self.json)  # type: ignore[arg-type]

    def key(self) -> str:
        """A stable hash of the constraint (not of `param`): the compile cache's key. A schema's key order
        is part of it: the output writes properties in that order."""
        value = getattr(self, self.kind)
        text = json.dumps([self.kind, list(value) if isinstance(value, tuple) else value], separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def from_dict(cls, body: Any, param: str = "structured_outputs") -> StructuredOutputsParams:
        """From vLLM's request field `{"json": ..., "regex": ..., "choice": [...], "grammar": ...}`."""
        if not isinstance(body, dict):
            raise InvalidRequestError(f"{param} must be an object", param=param)
        unknown = sorted(set(body) - set(KINDS) - {"disable_any_whitespace", "whitespace_pattern",
                                                   "disable_additional_properties", "structural_tag"})
        if unknown:
            raise InvalidRequestError(f"{param}: unknown field(s) {', '.join(unknown)}", param=param)
        if body.get("structural_tag") is not None:
            raise InvalidRequestError(f"{param}.structural_tag is not supported", param=param)
        choice = body.get("choice")
        if choice is not None and not isinstance(choice, list):
            raise InvalidRequestError(f"{param}.choice must be a list of strings", param=param)
        return cls(json=body.get("json"), regex=body.get("regex"),
                   choice=tuple(choice) if choice is not None else None, grammar=body.get("grammar"),
                   json_object=bool(body.get("json_object")), param=param)


def _schema_text(schema: Any, field: str) -> str:
    """A JSON schema (a dict or its text) checked for size, nesting and numbers, as compact JSON text."""
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_BYTES:
            raise InvalidRequestError(f"{field} is larger than the limit of {MAX_SPEC_BYTES} bytes", param=field)
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequestError(f"{field} is not valid JSON: {exc}", param=field) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"{field} must be a JSON schema object", param=field)
    problem = _schema_problem(schema)  # before encoding: the walk bounds the depth json.dumps recurses to
    if problem is not None:
        raise InvalidRequestError(f"{field}: {problem}", param=field)
    if _encoded_size_exceeds(schema, MAX_SPEC_BYTES):
        raise InvalidRequestError(f"{field} is not JSON or larger than the limit of {MAX_SPEC_BYTES} bytes",
                                  param=field)
    # ASCII: a lone surrogate stays an escape, so the text is valid UTF-8 wherever it goes.
    return json.dumps(schema, separators=(",", ":"), allow_nan=False)


def _schema_problem(root: Any) -> str | None:
    """What makes a decoded schema unfit for the compiler (numbers past 64 bits or not finite, nesting past
    MAX_SCHEMA_DEPTH counting each `$ref` followed), or None. Linear: a `$ref` target's height is kept."""
    heights: dict[str, int] = {}  # `$ref` -> the height of what it points to (0 while being measured)

    def height(node: Any, depth: int, path: str) -> int:
        if depth > MAX_SCHEMA_DEPTH:
            raise _Unfit(f"nested deeper than {MAX_SCHEMA_DEPTH} levels (each $ref counts as one) at {path}")
        if isinstance(node, bool) or node is None or isinstance(node, str):
            return 0
        if isinstance(node, int):
            if not -_INT64 <= node < _INT64:
                raise _Unfit(f"the integer at {path or '/'} is outside the 64-bit range")
            return 0
        if isinstance(node, float):
            if not math.isfinite(node):
                raise _Unfit(f"the number at {path or '/'} is not finite")
            return 0
        if isinstance(node, list):
            return 1 + max((height(item, depth + 1, f"{path}/{i}") for i, item in enumerate(node)), default=0)
        if not isinstance(node, dict):
            raise _Unfit(f"{type(node).__name__} at {path or '/'} is not JSON")
        below = 0
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref not in heights:
                heights[ref] = 0  # a cycle comes back here as 0: recursion is legal, its depth is not nesting
                target = _resolve_pointer(root, ref)
                heights[ref] = 0 if target is None else height(target, depth + 1, ref.removeprefix("#"))
            below = heights[ref]
            if depth + below > MAX_SCHEMA_DEPTH:
                raise _Unfit(f"nested deeper than {MAX_SCHEMA_DEPTH} levels (each $ref counts as one) at "
                             f"{path or '/'}")
        for key, value in node.items():
            below = max(below, height(value, depth + 1, f"{path}/{key}"))
        return 1 + below

    try:
        height(root, 0, "")
    except _Unfit as unfit:
        return str(unfit)
    return None


class _Unfit(Exception):
    pass


def _resolve_pointer(root: Any, ref: str) -> Any:
    """The node a local `$ref` (`#/$defs/a`, RFC 6901 escapes) points to in `root`, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _encoded_size_exceeds(value: object, limit: int) -> bool:
    """Whether `value` as JSON text is longer than `limit`, found without building all of it (an object
    that shares sub-objects can stand for an exponentially long text)."""
    size = 0
    try:
        for chunk in json.JSONEncoder().iterencode(value):
            size += len(chunk)
            if size > limit:
                return True
    except (TypeError, ValueError):  # not JSON at all (a set, a circular object): too odd to be a spec
        return True
    return False
