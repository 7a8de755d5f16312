"""Hostile constraints: refused at the door with a 400 naming their field, or served; never a crash, a hang or a
stalled engine. The spec's own checks, the door's compile worker (time budget, crash isolation, verdict cache),
the core compiling on a worker thread while it steps the others, and what crosses the wire."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest

from tests.conftest import TINY_PROMPTS
from tokenloop.core import wire
from tokenloop.core.core_loop import CoreLoop
from tokenloop.core.engine_core import EngineCore
from tokenloop.core.messages import AddRequests, CoreRequest, FinishRequests
from tokenloop.errors import InvalidRequestError
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint
from tokenloop.request import SamplingParams
from tokenloop.structured.compile_worker import GrammarChecker
from tokenloop.structured.spec import MAX_SCHEMA_DEPTH
from tokenloop.structured.spec import StructuredOutputsParams as SO


def nested_refs(levels: int) -> dict[str, Any]:
    """Each definition an object whose property refers to the next: nesting the compiler recurses over."""
    defs: dict[str, Any] = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
                            for i in range(levels - 1)}
    defs[f"d{levels - 1}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


# ---- the spec's own checks (no compiler involved) -------------------------------------------------------

@pytest.mark.parametrize("schema, words", [
    ({"type": "string", "maxLength": 18446744073709551616}, "64-bit"),
    ({"type": "integer", "minimum": -(2 ** 70)}, "64-bit"),
    ({"type": "number", "maximum": float("inf")}, "not finite"),
    ('{"type": "number", "maximum": NaN}', "not finite"),
    (nested_refs(1000), "nested deeper"),
    ({"$ref": "#/$defs/d0", "$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)}}, "nested deeper"),
])
def test_a_schema_out_of_bounds_is_refused_naming_the_field(schema: Any, words: str) -> None:
    for param, field in (("structured_outputs", "structured_outputs.json"),
                         ("response_format.json_schema", "response_format.json_schema")):
        with pytest.raises(InvalidRequestError) as info:
            SO(json=schema, param=param)
        assert info.value.param == field and words in str(info.value)


def test_recursion_and_shared_definitions_are_not_nesting() -> None:
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}
    SO(json=tree)  # a cycle is legal recursion
    shared = {"type": "object", "properties": {f"p{i}": {"$ref": "#/$defs/leaf"} for i in range(500)},
              "$defs": {"leaf": nested_refs(MAX_SCHEMA_DEPTH // 2)}}
    SO(json=shared)  # 500 references to one deep definition: measured once, not 500 times


def test_a_schema_travels_as_its_text_in_its_own_key_order() -> None:
    spec = SO(json={"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}})
    assert isinstance(spec.json, str) and spec.json.index('"b"') < spec.json.index('"a"')
    assert spec.schema["properties"]["b"] == {"type": "integer"}
    reordered = SO(json={"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}})
    assert spec.key() != reordered.key()  # the output writes properties in the schema's order
    params = SamplingParams(max_tokens=4, structured_outputs=spec)
    again = wire.decode(wire.encode(params))
    assert again.structured_outputs == spec and isinstance(again.structured_outputs.json, str)


def test_an_unencodable_message_fails_alone() -> None:
    good = AddRequests(1, [CoreRequest("good", [1, 2, 3], SamplingParams(max_tokens=2), 0)])
    bad = AddRequests(2, [CoreRequest("bad", [1, 2 ** 70], SamplingParams(max_tokens=2), 0)])
    frame, failures = wire.encode_sendable([good, bad, FinishRequests(["x"], "abort")])
    assert [m for m, _ in failures] == [bad] and isinstance(failures[0][1], OverflowError)
    assert frame is not None and [type(m) for m in wire.decode_batch(frame)] == [AddRequests, FinishRequests]


# ---- the door's worker ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checker(tiny: Checkpoint) -> Any:
    tokenizer = tiny.tokenizer
    made = GrammarChecker(tokenizer.backend.to_str(), tiny.config.vocab_size, tokenizer.eos_token_ids,
                          timeout_s=0.5, workers=1)
    yield made
    made.close()


def test_a_constraint_past_the_time_budget_is_a_400_and_the_next_one_compiles(checker: GrammarChecker) -> None:
    slow = SO(regex="(a{1000}){1000}")  # seconds of automaton building; llguidance's fuel does not bound it
    begin = time.monotonic()
    with pytest.raises(InvalidRequestError) as info:
        checker.check(slow)
    assert info.value.param == "structured_outputs.regex" and "longer than 0.5 s" in str(info.value)
    assert time.monotonic() - begin < 30  # the budget, plus a worker's start on a loaded machine
    checker.check(SO(regex="[a-z]{1,8}"))  # a fresh worker took over
    compiled = checker.num_compiled
    with pytest.raises(InvalidRequestError):  # the verdict is remembered: no second wait
        checker.check(slow)
    checker.check(SO(regex="[a-z]{1,8}"))
    assert checker.num_compiled == compiled


def test_a_constraint_that_crashes_the_compiler_is_a_400(checker: GrammarChecker) -> None:
    # Past the spec's own nesting check (built without it), as a hostile case the check does not know would
    # be: ~1,000 nested $refs make llguidance overflow its stack (SIGSEGV). Only the worker dies.
    crashing = object.__new__(SO)
    for name, value in (("json", wire_text(nested_refs(2000))), ("regex", None), ("choice", None),
                        ("grammar", None), ("json_object", False), ("param", "response_format.json_schema")):
        object.__setattr__(crashing, name, value)
    with pytest.raises(InvalidRequestError) as info:
        checker.check(crashing)
    assert info.value.param == "response_format.json_schema" and "crashed" in str(info.value)
    checker.check(SO(json={"type": "object", "properties": {"a": {"type": "integer"}}}))


def wire_text(schema: Any) -> str:
    import json

    return json.dumps(schema, separators=(",", ":"))


@pytest.mark.parametrize("spec, field", [
    (SO(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (SO(regex="(unclosed"), "structured_outputs.regex"),
    (SO(json={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}),
     "structured_outputs.json"),
])
def test_invalid_constraints_name_their_field(checker: GrammarChecker, spec: SO, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        checker.check(spec)
    assert info.value.param == field


# ---- the core compiles beside its steps -------------------------------------------------------------------

def test_the_core_steps_others_while_a_grammar_compiles_and_drops_an_aborted_one(tiny: Checkpoint) -> None:
    core = EngineCore(build_engine_config(str(tiny.path), block_size=4, num_blocks=128, dtype="float32"),
                      checkpoint=tiny)
    loop = CoreLoop(core)
    gate = threading.Event()
    build = core.structured.compiler._build

    def held_build(spec: SO) -> Any:  # the compile thread waits until the test lets it finish
        gate.wait(30)
        return build(spec)

    core.structured.compiler._build = held_build  # type: ignore[method-assign]
    ids = tiny.tokenizer.encode(TINY_PROMPTS[0])
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    constrained = dataclasses.replace(plain, structured_outputs=SO(regex="[a-z]{4}"))
    loop.apply(AddRequests(1, [CoreRequest("constrained", ids, constrained, 0)]))
    loop.apply(AddRequests(2, [CoreRequest("plain", ids, plain, 0)]))
    loop.apply(AddRequests(3, [CoreRequest("aborted", ids, dataclasses.replace(
        plain, structured_outputs=SO(regex="[0-9]{4}")), 0)]))
    loop.apply(FinishRequests(["aborted"], "abort"))
    answered: dict[int, Any] = {}
    finished: set[str] = set()
    for _ in range(8):  # the plain request runs to its end while both grammars are held
        frame = loop.turn()
        if frame is not None:
            answered.update({r.call_id: r for r in frame.results})
            finished.update(o.request_id for o in frame.outputs.outputs if o.finish_reason) if frame.outputs else None
    assert "plain" in finished and set(answered) == {2}
    assert not core.has_unfinished_requests() and loop.has_work  # parked, not lost
    gate.set()
    deadline = time.monotonic() + 30
    while loop.has_work or 1 not in answered or 3 not in answered:
        assert time.monotonic() < deadline, answered
        frame = loop.turn()
        if frame is not None:
            answered.update({r.call_id: r for r in frame.results})
            if frame.outputs:
                finished.update(o.request_id for o in frame.outputs.outputs if o.finish_reason)
        time.sleep(0.001)
    assert answered[1].error is None and answered[3].error is None
    assert "constrained" in finished and "aborted" not in finished
    core.kv_cache.check_invariants([])


def test_a_grammar_the_core_cannot_build_is_the_submissions_error(tiny: Checkpoint) -> None:
    core = EngineCore(build_engine_config(str(tiny.path), block_size=4, num_blocks=64, dtype="float32"),
                      checkpoint=tiny)
    loop = CoreLoop(core)
    ids = tiny.tokenizer.encode(TINY_PROMPTS[1])
    bad = SamplingParams(max_tokens=2, structured_outputs=SO(grammar="root ::= nowhere"))
    loop.apply(AddRequests(7, [CoreRequest("bad", ids, bad, 0)]))
    deadline = time.monotonic() + 30
    while True:
        frame = loop.turn()
        if frame is not None and frame.results:
            break
        assert time.monotonic() < deadline
        time.sleep(0.001)
    result, = frame.results
    assert result.call_id == 7 and result.error is not None
    assert result.error.kind == "InvalidRequestError" and result.error.param == "structured_outputs.grammar"
    assert not core.has_unfinished_requests() and not loop.has_work


# ---- against a live server: each hostile constraint is a 400 in bounded time; a plain request is unharmed ----

def _chain_gbnf(rules: int) -> str:
    return "\n".join(["root ::= r0", *(f'r{i} ::= "a" r{i + 1}' for i in range(rules - 1)), f'r{rules - 1} ::= "b"'])


def _deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


SELF_REQUIRED = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                                         "required": ["next"]}}}
HOSTILE: list[tuple[str, dict[str, Any], str, tuple[int, ...]]] = [
    ("gbnf-10k-chained-rules", {"structured_outputs": {"grammar": _chain_gbnf(10_000)}}, "structured_outputs.grammar",
     (400,)),
    ("choice-50k", {"structured_outputs": {"choice": [f"item{i}" for i in range(50_000)]}},
     "structured_outputs.choice", (400,)),
    ("regex-a-million", {"structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs.regex", (400,)),
    ("regex-nested-repeats", {"structured_outputs": {"regex": "(a{1000}){1000}"}}, "structured_outputs.regex", (400,)),
    ("gbnf-never-ends", {"structured_outputs": {"grammar": 'root ::= "a" root'}, "max_tokens": 200},
     "structured_outputs.grammar", (200, 400)),
    ("gbnf-undefined-rule", {"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs.grammar",
     (400,)),
    ("schema-pattern-bomb", {"structured_outputs": {"json": {"type": "string", "pattern": "(a{1000}){1000}"}}},
     "structured_outputs.json", (200, 400)),
    ("schema-deep", {"structured_outputs": {"json": _deep(200)}}, "structured_outputs.json", (400,)),
    ("schema-ref-cycle", {"structured_outputs": {"json": {"$ref": "#/$defs/a", "$defs": {
        "a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}}}, "structured_outputs.json", (400,)),
    ("schema-ref-chain", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "#/$defs/d0", "$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)}}}}},
     "response_format.json_schema", (400,)),
    ("schema-int-past-64-bits", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "maxLength": 18446744073709551616}}}}, "response_format.json_schema", (400,)),
    ("schema-required-self-reference", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SELF_REQUIRED}}}, "response_format.json_schema", (400,)),
    ("schema-3000-optional-properties", {"structured_outputs": {"json": {"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(3000)}}}}, "structured_outputs.json", (200, 400)),
]


@pytest.fixture(scope="module")
def hostile_server(tiny: Checkpoint) -> Any:
    import httpx

    from tests.serving.conftest import LiveServer, make_engine
    from tokenloop.config import ServerLimits
    from tokenloop.serving.app import create_app
    from tokenloop.serving.server import ServerThread

    engine = make_engine(tiny)
    app = create_app(engine, served_model_name="tiny", limits=ServerLimits(grammar_compile_timeout_s=1.0))
    with ServerThread(app, shutdown_timeout_s=1.0) as thread, httpx.Client(base_url=thread.url, timeout=120) as client:
        yield LiveServer(thread, client, engine, app.state.async_engine)


@pytest.mark.parametrize("name, fields, param, statuses", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_constraint_is_refused_at_the_door_and_a_plain_request_follows(
        hostile_server: Any, name: str, fields: dict[str, Any], param: str, statuses: tuple[int, ...]) -> None:
    client = hostile_server.client
    path = "/v1/chat/completions" if "response_format" in fields else "/v1/completions"
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    begin = time.monotonic()
    r = client.post(path, json={"model": "tiny", "max_tokens": 8, **base, **fields})
    took = time.monotonic() - begin
    assert r.status_code in statuses, r.text
    if r.status_code == 400:
        error = r.json()["error"]
        # The field, or a path inside it (the body parser names where JSON nesting passed its limit).
        assert error["param"].startswith(param) and error["type"] == "invalid_request_error", error
    # The budget (1 s) plus a fresh worker's start (~1-3 s on a loaded 2-core machine): never a hang.
    assert took < 30, f"{name}: answered after {took:.1f} s"
    time.sleep(0.5)  # the measure: a plain 8-token chat request 0.5 s after the hostile one
    begin = time.monotonic()
    plain = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 8, "ignore_eos": True,
                                                      "messages": [{"role": "user", "content": "hello"}]})
    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "length"
    assert time.monotonic() - begin < 5.0, f"{name}: the plain request took {time.monotonic() - begin:.1f} s"
    hostile_server.wait_idle()
