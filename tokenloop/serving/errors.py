"""API errors: an HTTP status plus OpenAI's error fields, and the mapping from everything else to them.

Every error body is `{"error": {"message", "type", "param", "code"}}`. Client errors are 4xx with a
message that names the field at fault in one sentence. An unexpected exception is a 500 whose message
is generic and carries a request id; its text and traceback go to the server log once, never to the client.
"""

from __future__ import annotations

import math
import types
import typing
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from tokenloop.errors import (
    AdapterNotFoundError,
    CapacityError,
    ClusterConflictError,
    EngineStoppedError,
    InvalidRequestError,
    ReplicaNotFoundError,
    RequestFailedError,
)
from tokenloop.serving.protocol import ErrorInfo, ErrorResponse
from tokenloop.serving.sse import frame


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def frame(self) -> str:
        """The error as an SSE frame, for failures after a stream has started."""
        return frame(self.body())


def invalid(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> APIError:
    """A client error (400 unless told otherwise)."""
    return APIError(status, message, "invalid_request_error", param, code)


def internal_error(incident: str | None = None) -> APIError:
    """The 500 a client sees for a bug: no exception text, an id to find the log line by."""
    incident = incident or new_incident_id()
    return APIError(500, f"internal server error (request id {incident}); the server log has the details",
                    "server_error", None, "internal_error")


def new_incident_id() -> str:
    return f"err-{uuid.uuid4().hex[:16]}"


def api_error(exc: BaseException) -> APIError:
    """Map an exception of ours to the API error a client should see (unknown ones: a generic 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, AdapterNotFoundError):  # unloaded after the front end checked the name
        return APIError(404, exc.message, "invalid_request_error", exc.param, "model_not_found")
    if isinstance(exc, InvalidRequestError):
        return invalid(exc.message, exc.param)
    if isinstance(exc, CapacityError):
        retry = max(1, math.ceil(exc.retry_after_s))
        return APIError(429, str(exc), "rate_limit_error", None, "rate_limit_exceeded",
                        headers={"Retry-After": str(retry)})
    if isinstance(exc, ReplicaNotFoundError):
        return APIError(404, str(exc), "not_found_error", None, "replica_not_found")
    if isinstance(exc, ClusterConflictError):
        return APIError(409, str(exc), "invalid_request_error", None, "conflict")
    if isinstance(exc, EngineStoppedError):
        return APIError(503, str(exc), "server_error", None, "service_unavailable")
    if isinstance(exc, RequestFailedError):
        # Its text is written by us and names no other request's data.
        return APIError(500, str(exc), "server_error", None, "internal_error")
    return internal_error()


# ---- pydantic validation errors as one sentence -------------------------------------------------------

_JSON_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", type(None): "null",
                    list: "an array", dict: "an object"}
_UNION_MEMBER_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def clipped(text: str, limit: int = 40) -> str:
    """A client's text as an error message quotes it: at most `limit` characters, each unprintable one (a
    newline, a control character, a lone surrogate) as `?`, so the message stays one short line."""
    shown = "".join(ch if ch.isprintable() else "?" for ch in text[:limit])
    return shown if len(text) <= limit else shown + "..."


def json_type_name(value: Any) -> str:
    for kind, name in _JSON_TYPE_NAMES.items():
        if type(value) is kind:
            return name
    return type(value).__name__


def describe_type(annotation: Any, plural: bool = False) -> str:
    """`str | list[int]` -> 'a string or a list of integers' (the accepted forms, in words)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        words = [describe_type(a, plural) for a in members]
        return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(annotation))
    if origin is list:
        (item,) = typing.get_args(annotation) or (Any,)
        return ("lists" if plural else "a list") + " of " + describe_type(item, plural=True)
    if origin is dict or annotation is dict:
        return "objects" if plural else "an object"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "objects" if plural else "an object"
    singular = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
    plurals = {str: "strings", int: "integers", float: "numbers", bool: "booleans"}
    if annotation in singular:
        return plurals[annotation] if plural else singular[annotation]
    return "values" if plural else "a value"


def validation_param(loc: Sequence[Any]) -> str | None:
    """`("body", "messages", 0, "content")` -> `messages[0].content`; union member tags are dropped."""
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path") else loc)
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        text = str(part)
        # pydantic names the union member it tried ('str', 'list[int]', 'function-after[...]'): not a field.
        if text in _UNION_MEMBER_TAGS or any(ch in text for ch in "[]-("):
            break
        out = f"{out}.{text}" if out else text
    return out or None


def _field_annotation(model: type[BaseModel] | None, param: str) -> Any:
    """The declared type of a top-level field (None for nested paths or unknown fields)."""
    if model is None or not param.isidentifier():
        return None
    info = model.model_fields.get(param)
    return info.annotation if info is not None else None


def validation_error(errors: Sequence[Any], model: type[BaseModel] | None = None) -> APIError:
    """One clear sentence for a failed pydantic validation: the field, what it accepts, what it got."""
    first = dict(errors[0]) if errors else {}
    param = validation_param(first.get("loc", ()))
    kind = first.get("type", "")
    if param is None:
        return invalid("the request body must be a JSON object")
    if kind == "missing":
        return invalid(f"{param} is required", param)
    if kind == "too_short":
        return invalid(f"{param} must not be empty", param)
    annotation = _field_annotation(model, param)
    if type(first.get("input")) is int and kind in ("float_type", "finite_number"):
        return invalid(f"{param} is out of range: it does not fit a 64-bit float", param)
    same_field = [e for e in errors if validation_param(e.get("loc", ())) == param]
    value = first.get("input")
    if annotation is not None and (len(same_field) > 1 or kind.endswith("_type") or kind.endswith("_parsing")):
        return invalid(f"{param} must be {describe_type(annotation)}, got {json_type_name(value)}", param)
    message = str(first.get("msg", "is invalid"))
    if kind.endswith("_type"):
        message = f"{param} has the wrong type: {message[0].lower()}{message[1:]}, got {json_type_name(value)}"
    else:
        message = f"{param}: {message}"
    return invalid(message, param)
