"""Issue 34 item 6: schemathesis over the server's own /openapi.json, every route, with widened values.

Cases come from schemathesis (positive and negative generation, every operation the live server's
/openapi.json lists), then up to three places of each (a body field, a value deep inside the body, the
whole body, a query or path parameter) are replaced by hostile values: integers past 64 bits, non-finite
floats (sent as bare NaN / Infinity), nesting up to thousands of levels, long strings. The property that
holds for every case (`FuzzRun.exchange`): no 5xx, an OpenAI error body for every error, an answer within
`FuzzBounds.answer_s`, the engine and the server alive and /health 200 afterwards, and a greedy request
sent over and over beside the fuzzing (`GreedyBystander`) always reads its reference text.

Used by tests/serving/test_schema_fuzz.py (a short derandomized run in `make test`) and by
scripts/fuzz_api.py (the long run whose figures are in BENCHMARKS.md).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET

from tests.serving.conftest import MODEL, LiveServer
from tests.serving.hostile_util import AUTH, assert_error

ABSENT = object()


@dataclass(frozen=True)
class FuzzBounds:
    """How hostile the values get, and how long an answer may take."""

    max_chars: int = 20_000  # the longest string sent
    max_depth: int = 5_000  # the deepest nesting sent (the server refuses past its max_json_depth, 64)
    answer_s: float = 20.0  # a case's whole answer, body included


@dataclass(frozen=True)
class Deep:
    """`depth` nested lists (or objects) around `leaf`: written as JSON text directly, since Python's own
    encoder recurses and stops near 1,000 levels."""

    depth: int
    objects: bool = False
    leaf: Any = 0


# ---- hostile values --------------------------------------------------------------------------------

HUGE_INTS = st.one_of(
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, -(2**64), 10**30, 10**400,
                     -(10**400)]),
    st.integers(min_value=2**64, max_value=2**300),
    st.integers(min_value=-(2**300), max_value=-(2**63) - 1),
)
NON_FINITE = st.sampled_from([float("nan"), float("inf"), float("-inf"), 3.5e38, -3.5e38,
                              1.7976931348623157e308, 5e-324, -0.0])
SPICY = ["a", " ", "\n", "\x00", "\ud800", "\udfff", "é", "🙂", "<|im_start|>", "<|endoftext|>", "{{", "%",
         "\\", '"', "\u2028", "\ufeff"]


def long_strings(max_chars: int) -> st.SearchStrategy[str]:
    lengths = [n for n in (256, 4_096, 65_536, 1_000_000) if n <= max_chars] + [max_chars]
    return st.builds(lambda piece, n: (piece * (n // max(1, len(piece)) + 1))[:n],
                     st.lists(st.sampled_from(SPICY), min_size=1, max_size=4).map("".join),
                     st.sampled_from(lengths))


def deep_values(max_depth: int) -> st.SearchStrategy[Deep]:
    depths = [d for d in (16, 63, 64, 65, 200, 1_000, 5_000, 100_000) if d <= max_depth]
    return st.builds(Deep, st.sampled_from(depths), st.booleans(), st.sampled_from([0, "x", None, 2**64]))


def hostile_values(bounds: FuzzBounds) -> st.SearchStrategy[Any]:
    """One hostile value, or a short list of them."""
    one = st.one_of(HUGE_INTS, NON_FINITE, long_strings(bounds.max_chars), deep_values(bounds.max_depth))
    return st.one_of(one, one, one, st.lists(one, min_size=1, max_size=3))


def encode(body: Any) -> bytes:
    """JSON text as a hostile client writes it: NaN / Infinity bare, lone surrogates as escapes, `Deep`
    values spelled out to their full depth."""
    if isinstance(body, bytes):  # schemathesis's negative cases include raw bytes
        return body
    return json_text(body).encode("ascii")


def json_text(body: Any, ensure_ascii: bool = True) -> str:
    """`body` as JSON text (see `encode`); with `ensure_ascii` off, characters are left as they are."""
    deep: list[Deep] = []

    def mark(value: Any) -> Any:
        if isinstance(value, Deep):
            deep.append(value)
            return f"\x00deep{len(deep) - 1}\x00"
        raise TypeError(type(value).__name__)

    text = json.dumps(body, ensure_ascii=ensure_ascii, allow_nan=True, default=mark)
    for i, value in enumerate(deep):
        opener, closer = ('{"k":', "}") if value.objects else ("[", "]")
        leaf = json.dumps(value.leaf)
        marker = json.dumps(f"\x00deep{i}\x00", ensure_ascii=ensure_ascii)
        text = text.replace(marker, opener * value.depth + leaf + closer * value.depth)
    return text


def describe(value: Any, limit: int = 300) -> str:
    """A short, readable reproducer of a body or a value (long strings and deep nesting summarized)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


# ---- cases -----------------------------------------------------------------------------------------

@dataclass
class Call:
    """One HTTP request of the fuzz run, before it is sent."""

    method: str
    template: str
    path_parameters: dict[str, Any]
    query: dict[str, Any]
    body: Any = ABSENT
    media_type: str = "application/json"
    auth: bool = True
    widened: list[str] = field(default_factory=list)  # where hostile values went, for the report

    @property
    def path(self) -> str:
        """The request target: path and query, percent-encoded (a lone surrogate as its invalid UTF-8)."""
        path = self.template
        for name, value in self.path_parameters.items():
            path = path.replace("{" + name + "}", _quote(_as_text(value)))
        if self.query:
            path += "?" + urlencode({k: _as_text(v) for k, v in self.query.items()}, quote_via=_quote)
        return path

    def __repr__(self) -> str:  # hypothesis prints a falsifying call with it
        return (f"Call({self.method} {describe(self.path, 120)} query={describe(self.query, 120)} "
                f"body={describe(self.body)} media_type={self.media_type!r} auth={self.auth} "
                f"widened={self.widened})")


# A path or query value is cut to this: a request line past h11's 16 KB limit is refused by the HTTP parser
# in plain text, a known issue-34 problem fixed on another branch ("HTTP-parser errors in plain text").
MAX_URL_VALUE_CHARS = 2_000


def _quote(text: str, *_: Any) -> str:
    return quote(text[:MAX_URL_VALUE_CHARS], safe="", errors="surrogatepass")


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json_text(value, ensure_ascii=False)


def body_fields(raw_schema: dict[str, Any], path: str, method: str) -> list[str]:
    """Every property name the schema gives the JSON body of `method path` (over anyOf members)."""
    operation = raw_schema["paths"][path].get(method.lower(), {})
    content = operation.get("requestBody", {}).get("content", {}).get("application/json")
    if content is None:
        return []
    components = raw_schema.get("components", {}).get("schemas", {})
    names: set[str] = set()
    for member in content["schema"].get("anyOf", [content["schema"]]):
        target = components[member["$ref"].rsplit("/", 1)[1]] if "$ref" in member else member
        names.update(target.get("properties", {}))
    return sorted(names)


# Small valid bodies per JSON route, one of which most cases start from: schemathesis's own bodies rarely
# pass the semantic checks (a random model name, n past its limit), and these hold the nested shapes
# (schemas, tools, content parts) whose leaves the widening then replaces.
_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5},
                                            "b": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "c": {"type": "array", "items": {"enum": ["x", "y"]},
                                                  "maxItems": 2}},
           "required": ["a"]}
_TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": _SCHEMA}}
VALID_BODIES: dict[str, list[dict[str, Any]]] = {
    "/v1/completions": [
        {"model": MODEL, "prompt": "hello world", "max_tokens": 3, "temperature": 0.0},
        {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 2, "echo": True},
        {"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 2, "stop": ["x"], "seed": 3},
        {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True,
         "stream_options": {"include_usage": True}},
        {"model": MODEL, "prompt": "x", "max_tokens": 2, "logit_bias": {"5": 1.0}, "stop_token_ids": [7],
         "top_k": 5, "top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.1, "presence_penalty": 0.5},
        {"model": MODEL, "prompt": "x", "max_tokens": 3, "structured_outputs": {"choice": ["yes", "no"]}},
        {"model": MODEL, "prompt": "x", "max_tokens": 3, "structured_outputs": {"regex": "[a-z]{1,5}"}},
    ],
    "/v1/chat/completions": [
        {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3},
        {"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                      {"role": "assistant", "content": "hello"},
                                      {"role": "user", "content": "again"}],
         "max_tokens": 2, "logprobs": True, "top_logprobs": 2, "stream": True},
        {"model": MODEL, "messages": [{"role": "user", "content": "json"}], "max_tokens": 4,
         "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": _SCHEMA}}},
        {"model": MODEL, "messages": [{"role": "user", "content": "call"}], "max_tokens": 4, "tools": [_TOOL],
         "tool_choice": {"type": "function", "function": {"name": "f"}}},
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
         "structured_outputs": {"json": _SCHEMA}, "chat_template_kwargs": {"enable_thinking": False}},
    ],
    "/tokenize": [{"model": MODEL, "prompt": "hello world"},
                  {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                   "return_token_strs": True}],
    "/detokenize": [{"model": MODEL, "tokens": [5, 6, 7]}],
}


def _widen_inside(draw: st.DrawFn, container: Any, value: Any) -> Any:
    """`container` with one value somewhere inside it replaced by `value` (a copy along the way)."""
    if isinstance(container, dict) and container:
        key = draw(st.sampled_from(sorted(container)))
        return {**container, key: _widen_inside(draw, container[key], value)}
    if isinstance(container, list) and container:
        i = draw(st.integers(0, len(container) - 1))
        return container[:i] + [_widen_inside(draw, container[i], value)] + container[i + 1:]
    return value


def call_strategy(url: str, bounds: FuzzBounds) -> st.SearchStrategy[Call]:
    """Calls built from the live server's /openapi.json: schemathesis's cases, then widened."""
    raw_schema = httpx.get(url + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(raw_schema)
    operations = [result.ok() for result in schema.get_all_operations()]
    cases = st.one_of([op.as_strategy(generation_mode=mode) for op in operations
                       for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])
    values = hostile_values(bounds)
    fields = {(op.method.upper(), op.path): body_fields(raw_schema, op.path, op.method) for op in operations}

    @st.composite
    def build(draw: st.DrawFn) -> Call:
        case = draw(cases)
        call = Call(case.method.upper(), case.path, dict(case.path_parameters or {}), dict(case.query or {}),
                    ABSENT if case.body is NOT_SET else case.body, case.media_type or "application/json",
                    auth=draw(st.sampled_from([True] * 9 + [False])))
        if call.template in VALID_BODIES and isinstance(call.body, dict) and draw(st.booleans()):
            valid = draw(st.sampled_from(VALID_BODIES[call.template]))
            # A valid body with at most two of the generated fields: reaches the checks past the first one.
            kept = draw(st.lists(st.sampled_from(sorted(call.body) or ["model"]), max_size=2, unique=True))
            call.body = {**valid, **{name: call.body[name] for name in kept if name in call.body}}
        places = ["query"] + (["path"] if call.path_parameters else [])
        names = fields[(call.method, call.template)]
        if names:
            places += ["inside", "whole"]
            places += ["field", "field", "field"]
            if call.body is ABSENT:
                call.body = {}
        for _ in range(draw(st.integers(0, 3))):
            if not isinstance(call.body, dict):  # a field needs an object (the body may be one no more)
                places = [p for p in places if p != "field"]
            place, value = draw(st.sampled_from(places)), draw(values)
            if place == "field":
                name = draw(st.sampled_from(sorted(set(names) | set(call.body))))
                call.body = {**call.body, name: value}
                place = f"field {name}"
            elif place == "inside":
                call.body = _widen_inside(draw, call.body, value)
            elif place == "whole":
                call.body = value
                places = [p for p in places if p not in ("field", "inside", "whole")]
            elif place == "path":
                call.path_parameters[draw(st.sampled_from(sorted(call.path_parameters)))] = value
            else:
                call.query[draw(st.sampled_from(["format", "to", "model", "x"]))] = _as_text(value)
            call.widened.append(place)
        return call

    return build()


# ---- the property ----------------------------------------------------------------------------------

# Input classes of issue 34 that another branch is fixing: a case in one of them is reported, not failed.
KNOWN_ISSUES = {
    "tool_calls": "issue 34: malformed assistant tool_calls in the history -> 500",
}


def known_issue(call: Call) -> str | None:
    """The known issue-34 problem `call` may hit, if any (a 5xx there is counted as known)."""
    messages = call.body.get("messages") if isinstance(call.body, dict) else None
    if isinstance(messages, list) and any(isinstance(m, dict) and "tool_calls" in m for m in messages):
        return KNOWN_ISSUES["tool_calls"]
    return None


def warm_up(live: LiveServer) -> None:
    """One request of each constrained kind first: the first constraint a server compiles starts its compile
    worker and imports the grammar library (2-13 s on this loaded machine), a start-up cost that the
    per-case answer bound is not about. (A body with tools is past a 64-token context: not sent.)"""
    for path, bodies in VALID_BODIES.items():
        for body in bodies:
            if {"response_format", "structured_outputs"} & set(body) and "tools" not in body:
                r = live.client.post(path, json=body, headers=AUTH, timeout=120.0)
                assert r.status_code == 200, r.text[:300]


class GreedyBystander(threading.Thread):
    """A greedy completion sent again and again while the fuzzing runs; its text must never change."""

    BODY = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0.0}

    def __init__(self, url: str, timeout_s: float) -> None:
        super().__init__(name="greedy-bystander", daemon=True)
        self._client = httpx.Client(base_url=url, headers=AUTH, timeout=timeout_s)
        self.reference = self._ask()
        self.compared = 0
        self.mismatches: list[str] = []
        self._done = threading.Event()

    def _ask(self) -> str:
        r = self._client.post("/v1/completions", json=self.BODY)
        if r.status_code != 200:
            return f"<status {r.status_code}: {r.text[:200]}>"
        return r.json()["choices"][0]["text"]

    def run(self) -> None:
        while not self._done.is_set():
            try:
                text = self._ask()
            except httpx.HTTPError as exc:
                text = f"<{type(exc).__name__}>"
            if text != self.reference:
                self.mismatches.append(text)
            self.compared += 1

    def stop(self) -> None:
        """Stop asking (after the request in flight); idempotent."""
        self._done.set()
        if self.is_alive():
            self.join(timeout=60)
        self._client.close()


@dataclass
class FuzzRun:
    """The fuzz run against one live server: sends calls, checks the property, counts what it saw."""

    live: LiveServer
    bounds: FuzzBounds
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # a 5xx, a slow or missing answer, a bad error body
    known: list[str] = field(default_factory=list)  # failures in a class of KNOWN_ISSUES
    deaths: int = 0
    slowest_s: float = 0.0
    slowest_call: str = ""

    @property
    def cases(self) -> int:
        return sum(self.statuses.values())

    def exchange(self, call: Call) -> str | None:
        """Send `call`, check the property; returns what failed (None when all held)."""
        problem = self._answer_problem(call)
        if not self.alive():
            self.deaths += 1
            problem = f"the engine or the server died ({problem or 'after an answer'})"
        if problem is not None:
            issue = known_issue(call)
            if issue:
                self.known.append(f"{issue}: {problem}: {call!r}")
            else:
                self.failures.append(f"{problem}: {call!r}")
        return problem

    def _answer_problem(self, call: Call) -> str | None:
        headers = {**(AUTH if call.auth else {}), "Content-Type": call.media_type}
        content = None if call.body is ABSENT else encode(call.body)
        begin = time.monotonic()
        try:
            r = self.live.client.request(call.method, call.path, content=content,
                                         headers=headers, timeout=self.bounds.answer_s)
        except httpx.TimeoutException:
            return f"no answer within {self.bounds.answer_s} s"
        except httpx.HTTPError as exc:
            return f"the connection failed: {type(exc).__name__}"
        elapsed = time.monotonic() - begin
        if elapsed > self.slowest_s:
            self.slowest_s, self.slowest_call = elapsed, f"{r.status_code} {call!r}"
        self.statuses[r.status_code] += 1
        if r.status_code >= 500:
            return f"status {r.status_code}: {r.text[:300]}"
        if elapsed > self.bounds.answer_s:
            return f"answered in {elapsed:.1f} s (bound {self.bounds.answer_s} s)"
        if r.status_code >= 400:
            try:  # any error type the server names (not_found_error, ...); the shape is what is checked
                kind = r.json().get("error", {}).get("type") if isinstance(r.json(), dict) else None
                assert_error(r, r.status_code, names_field=False,
                             type_=kind if isinstance(kind, str) else None)
            except (AssertionError, ValueError, AttributeError) as exc:
                return f"status {r.status_code} without an OpenAI error body: {str(exc)[:300]}"
        return None

    def alive(self) -> bool:
        if not self.live.async_engine.is_running:
            return False
        try:
            return self.live.client.get("/health", timeout=10.0).status_code == 200
        except httpx.HTTPError:
            return False
