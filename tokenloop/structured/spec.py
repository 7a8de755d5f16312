"""What a request constrains its output to: a JSON schema, JSON mode, a regex, a choice or a grammar.

`StructuredOutputsParams` is vLLM's `structured_outputs` (json, regex, choice, grammar, json_object); OpenAI's
`response_format` and forced tool calls are translated into it at the edge. It is a plain frozen
dataclass (it travels inside `SamplingParams`), and `key()` names the grammar it compiles to, so that
equal specs share one compiled grammar whatever their dict ordering.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tokenloop.errors import InvalidRequestError

# The vLLM field names, in the order a spec is checked.
KINDS = ("json", "regex", "choice", "grammar", "json_object")
# A spec's JSON text may be at most this long: grammars grow with it, and so does compile time.
MAX_SPEC_BYTES = 256 * 1024


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint on the output text.

    `json`: a JSON schema (a dict or its JSON text). `regex`: a regular expression the whole output
    matches. `choice`: the output is one of these strings. `grammar`: an EBNF grammar (GBNF as llama.cpp
    writes it, or Lark). `json_object`: any JSON object (OpenAI's JSON mode). `param` names the request
    field the spec came from, so a compile error can say which field was wrong.
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
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as exc:
                message = f"{self.param}.json is not valid JSON: {exc}"
                raise InvalidRequestError(message, param=self.param) from None
            object.__setattr__(self, "json", parsed)
        if self.json is not None and not isinstance(self.json, dict) and not isinstance(self.json, bool):
            raise InvalidRequestError(f"{self.param}.json must be a JSON schema object", param=self.param)
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{self.param}.{kind} must be a non-empty string", param=self.param)
        value = getattr(self, self.kind)
        if _encoded_size_exceeds(list(value) if isinstance(value, tuple) else value, MAX_SPEC_BYTES):
            raise InvalidRequestError(f"{self.param}: the {self.kind} is not JSON or larger than the limit "
                                      f"of {MAX_SPEC_BYTES} bytes", param=self.param)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> str:
        """A stable hash of the constraint (not of `param`): the compile cache's key."""
        value = getattr(self, self.kind)
        text = json.dumps([self.kind, list(value) if isinstance(value, tuple) else value], sort_keys=True,
                          separators=(",", ":"))
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
