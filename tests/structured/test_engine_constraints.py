"""Constrained decoding through the engine on the tiny random model: regex, choice, grammar and JSON
outputs match, constraint state survives preemption, prefix hits and chunked prefill, n>1 samples
each get their own matcher, and unconstrained neighbours are unchanged."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.conftest import TINY_PROMPTS
from tests.test_engine import make_llm
from tokenloop import LLM, SamplingParams
from tokenloop.errors import InvalidRequestError
from tokenloop.model.loader import Checkpoint
from tokenloop.structured import StructuredOutputsParams as SO
from tokenloop.structured.matcher import RequestMatcher

REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def params(spec: SO, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 40)
    return SamplingParams(structured_outputs=spec, **kw)


def texts(llm: LLM, prompts: list[str], p: SamplingParams | list[SamplingParams]) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(prompts, p, use_tqdm=False)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_grammar_and_json_outputs_match(tiny: Checkpoint, temperature: float) -> None:
    llm = make_llm(tiny)
    prompts = TINY_PROMPTS[:3]
    for out in llm.generate(prompts, params(SO(regex=REGEX), temperature=temperature, seed=1), use_tqdm=False):
        assert re.fullmatch(REGEX, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
    for text in texts(llm, prompts, params(SO(choice=("yes", "no", "maybe")), temperature=temperature, seed=2)):
        assert text in ("yes", "no", "maybe")
    grammar = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]{1,2} | "(" expr ")"'
    arith = re.compile(r"[0-9()+\-]+")
    for out in llm.generate(prompts, params(SO(grammar=grammar), temperature=temperature, seed=3, max_tokens=20),
                            use_tqdm=False):
        text = out.outputs[0].text
        assert arith.fullmatch(text), text
        if out.outputs[0].finish_reason == "stop":
            assert _is_arith(text), text
    for out in llm.generate(prompts, params(SO(json=SCHEMA), temperature=temperature, seed=4, max_tokens=60),
                            use_tqdm=False):
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def _is_arith(text: str) -> bool:
    """A recursive-descent check of the grammar's sentences (digits of 1-2, +/-, parentheses)."""
    pos = 0

    def term() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        start = pos
        while pos < len(text) and text[pos].isdigit() and pos - start < 2:
            pos += 1
        return pos > start

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            if not term():
                return False
        return True

    return expr() and pos == len(text)


def test_constraint_state_survives_preemption_prefix_hits_and_chunking(tiny: Checkpoint) -> None:
    prompts = TINY_PROMPTS
    p = [params(SO(regex=r"[a-z ]{10,30}\."), max_tokens=32), params(SO(json=SCHEMA), max_tokens=48)] * 3
    p = p[:len(prompts)]
    alone = [texts(make_llm(tiny), [prompt], q)[0] for prompt, q in zip(prompts, p)]
    assert texts(make_llm(tiny), prompts, p) == alone
    assert texts(make_llm(tiny, max_num_batched_tokens=7), prompts, p) == alone
    squeezed = make_llm(tiny, num_blocks=24)
    assert texts(squeezed, prompts, p) == alone
    assert squeezed.engine.stats().num_preemptions > 0
    cached = make_llm(tiny)
    texts(cached, prompts, p)
    assert texts(cached, prompts, p) == alone
    assert cached.engine.stats().prefix_cache_hits > 0


def test_unconstrained_neighbours_are_unchanged(tiny: Checkpoint) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    alone = texts(make_llm(tiny), TINY_PROMPTS[:2], [plain, seeded])
    mixed = texts(make_llm(tiny), TINY_PROMPTS[:2] + TINY_PROMPTS[2:4],
                  [plain, seeded, params(SO(json=SCHEMA)), params(SO(regex=REGEX), temperature=1.0)])
    assert mixed[:2] == alone


def test_n_samples_have_their_own_matchers_and_state_is_exportable(tiny: Checkpoint) -> None:
    llm = make_llm(tiny)
    out = llm.generate([TINY_PROMPTS[0]], params(SO(regex=REGEX), n=4, temperature=1.0, seed=5), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    assert all(re.fullmatch(REGEX, c.text) for c in out.outputs)
    assert len({c.text for c in out.outputs}) > 1
    # The exported state (accepted tokens) replays into a fresh matcher of the same grammar.
    grammar = llm.engine.structured.compile(SO(regex=REGEX))
    assert llm.engine.structured.compiler.stats.hits >= 1  # the same spec came from the cache
    source = grammar.new_matcher()
    for token in out.outputs[0].token_ids:
        if not source.is_terminated:
            assert source.accept(token)
    copy = RequestMatcher.restore(grammar.new_matcher(), source.export_state())
    assert copy.export_state() == source.export_state() and copy.is_terminated == source.is_terminated


def test_abort_and_length_and_errors(tiny: Checkpoint) -> None:
    llm = make_llm(tiny)
    engine = llm.engine
    engine.add_request("a", TINY_PROMPTS[0], params(SO(json=SCHEMA)))
    engine.step()
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    # A schema the model cannot finish within max_tokens: "length", and the text is valid so far.
    out = llm.generate([TINY_PROMPTS[1]], params(SO(json=SCHEMA), max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.text.startswith("{")
    for bad in (SO(regex="(unclosed"), SO(grammar="root ::= missing_rule"),
                SO(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})):
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(None, TINY_PROMPTS[0], params(bad))
        assert info.value.param == f"structured_outputs.{bad.kind}"
    with pytest.raises(InvalidRequestError):
        SO(json="{not json")
    with pytest.raises(InvalidRequestError):
        SO(regex="a", choice=("b",))
    assert not engine.has_unfinished_requests()


def test_the_first_compile_builds_the_compiler_off_the_calling_thread(
        tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """The core's loop calls compile_later; building the compiler (imports of seconds: issue 34's fuzz run
    saw the core killed by its hang watch for it) must happen on another thread; the spec still compiles."""
    import threading

    from tokenloop.structured import compiler as compiler_module
    from tokenloop.structured.engine_hooks import StructuredOutputs

    built_on: list[threading.Thread] = []
    real_init = compiler_module.GrammarCompiler.__init__

    def recording_init(self: compiler_module.GrammarCompiler, *args: object, **kwargs: object) -> None:
        built_on.append(threading.current_thread())
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(compiler_module.GrammarCompiler, "__init__", recording_init)
    hooks = StructuredOutputs(tiny.tokenizer, tiny.config.vocab_size)
    try:
        first = hooks.compile_later([None, SO(regex="[a-z]{1,3}")])
        assert len(first) == 1 and first[0].result(timeout=60).key
        assert built_on and built_on[0] is not threading.current_thread()
        later = hooks.compile_later([SO(choice=("yes", "no"))])  # the compiler exists: its own pool
        assert later[0].result(timeout=60).key and len(built_on) == 1
    finally:
        hooks.close()
