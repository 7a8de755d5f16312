"""The soak's extra request kinds: hostile constraints, valid structured outputs and long prompts.

Each hostile constraint must get a 4xx whose `param` names its field; each valid constraint a 200 whose
output obeys it; a long prompt (thousands of tokens) an ordinary answer. `tokenloop.bench.soak_cluster`
mixes them into its traffic.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from tokenloop.bench.soak import TOPICS, SoakReport


def _chained_grammar(rules: int) -> str:
    """A GBNF of `rules` rules, each calling the next: the compiler's work grows with the chain."""
    lines = ["root ::= r0"] + [f'r{i} ::= "a" r{i + 1}' for i in range(rules - 1)] + [f'r{rules - 1} ::= "a"']
    return "\n".join(lines)


def _nested_refs(levels: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
                            for i in range(levels - 1)}
    defs[f"d{levels - 1}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _chat(constraint: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Answer."}], "max_tokens": 8, **constraint}


def _completion(structured: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": "Answer:", "max_tokens": 8, "structured_outputs": structured}


def _json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@dataclass(frozen=True)
class HostileConstraint:
    """A constraint that must be refused at the door: a 4xx whose `param` is `field` (or a sub-path)."""

    name: str
    chat: bool
    body: dict[str, Any]
    field: str


HOSTILE_CONSTRAINTS: list[HostileConstraint] = [
    HostileConstraint("regex a{1000000}", False, _completion({"regex": "a{1000000}"}),
                      "structured_outputs.regex"),
    HostileConstraint("regex (a{1000}){1000}", False, _completion({"regex": "(a{1000}){1000}"}),
                      "structured_outputs.regex"),
    HostileConstraint("GBNF of 10,000 chained rules", False,
                      _completion({"grammar": _chained_grammar(10_000)}),
                      "structured_outputs.grammar"),
    HostileConstraint("GBNF with an undefined rule", False, _completion({"grammar": "root ::= nowhere"}),
                      "structured_outputs.grammar"),
    HostileConstraint("JSON schema integer past 64 bits", True,
                      _chat(_json_schema_format({"type": "integer", "minimum": -(2 ** 70)})),
                      "response_format.json_schema"),
    HostileConstraint("JSON schema of 1,000 nested $refs", False, _completion({"json": _nested_refs(1000)}),
                      "structured_outputs.json"),
    HostileConstraint("JSON schema $ref cycle", False, _completion(
        {"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}}),
        "structured_outputs.json"),
]

PERSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
EMAIL_REGEX = r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"
COLOURS = ["red", "green", "blue", "yellow"]


def _valid_person(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "age"}
            and isinstance(value["name"], str) and re.fullmatch(r"[A-Za-z]{1,10}", value["name"]) is not None
            and type(value["age"]) is int and 0 <= value["age"] <= 120)


@dataclass(frozen=True)
class StructuredRequest:
    """A valid constraint: it must get a 200, end with `stop`, and its text must pass `valid`."""

    name: str
    chat: bool
    body: dict[str, Any]
    valid: Callable[[str], bool]


# max_tokens leaves ample room: each constrained output is at most a few dozen tokens, so it ends with 'stop'.
STRUCTURED_REQUESTS: list[StructuredRequest] = [
    StructuredRequest("json schema (response_format)", True,
                      {"messages": [{"role": "user", "content": "Give a person as JSON."}], "max_tokens": 96,
                       **_json_schema_format(PERSON_SCHEMA)}, _valid_person),
    StructuredRequest("json schema (structured_outputs)", False,
                      {"prompt": "A person as JSON:", "max_tokens": 96,
                       "structured_outputs": {"json": PERSON_SCHEMA}},
                      _valid_person),
    StructuredRequest("regex", False, {"prompt": "An email address:", "max_tokens": 48,
                                       "structured_outputs": {"regex": EMAIL_REGEX}},
                      lambda text: re.fullmatch(EMAIL_REGEX, text) is not None),
    StructuredRequest("choice", True, {"messages": [{"role": "user", "content": "Pick a colour."}],
                                       "max_tokens": 16, "structured_outputs": {"choice": COLOURS}},
                      lambda text: text in COLOURS),
]


def long_prompt(rng: random.Random, index: int, words: int) -> str:
    """About `words` words (~1.3 tokens each) that share no prefix with another long prompt."""
    sentences = [f"Note {index}.{i}: {rng.choice(TOPICS)} matters in its own way."
                 for i in range(words // 8 + 1)]
    return " ".join(sentences) + "\nSummarise the notes above in one sentence:"


def _text(body: dict[str, Any], chat: bool) -> tuple[str, str]:
    choice = body["choices"][0]
    return (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]


async def run_hostile_constraint(client: httpx.AsyncClient, case: HostileConstraint,
                                 report: SoakReport) -> None:
    """Send it; a 4xx naming its field is a rejection, anything else a violation."""
    path = "/v1/chat/completions" if case.chat else "/v1/completions"
    r = await client.post(path, json=case.body)
    param = None
    if 400 <= r.status_code < 500:
        try:
            param = r.json()["error"].get("param")
        except (ValueError, KeyError, AttributeError):
            param = None
    if 400 <= r.status_code < 500 and isinstance(param, str) and (
            param == case.field or param.startswith(case.field + ".")):
        report.outcomes[f"rejected_{r.status_code}"] += 1
        report.outcomes["failed_by_own_fault"] += 1
        return
    report.outcomes[f"hostile_http_{r.status_code}"] += 1
    report.violations.append(f"hostile constraint {case.name!r}: HTTP {r.status_code}, param {param!r} "
                             f"(wanted "
                             f"a 4xx naming {case.field}): {r.text[:200]}")


async def run_structured(client: httpx.AsyncClient, case: StructuredRequest, report: SoakReport) -> None:
    """Send it; it must get a 200 whose output obeys the constraint."""
    path = "/v1/chat/completions" if case.chat else "/v1/completions"
    began = time.monotonic()
    r = await client.post(path, json=case.body)
    if r.status_code == 429:
        report.outcomes["rejected_429"] += 1
        return
    if r.status_code != 200:
        report.outcomes[f"http_{r.status_code}"] += 1
        report.violations.append(f"structured {case.name!r}: HTTP {r.status_code}: {r.text[:200]}")
        return
    text, reason = _text(r.json(), case.chat)
    report.finish_reasons[reason] += 1
    if reason != "stop" or not case.valid(text):
        report.outcomes["structured_invalid"] += 1
        report.violations.append(f"structured {case.name!r}: finish {reason!r}, output not valid: "
                                 f"{text[:200]!r}")
        return
    report.outcomes["completed"] += 1
    report.outcomes["structured_valid"] += 1
    report.latencies_s.append(time.monotonic() - began)
