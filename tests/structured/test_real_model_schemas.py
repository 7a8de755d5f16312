"""100 generated JSON schemas on the real default model: every output parses and validates (greedy and
sampled, batched with unconstrained requests), an output cut by max_tokens is valid so far, and the
unconstrained neighbours' outputs are what they are alone."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.conftest import requires_default_model
from tests.structured.schemas import generate_schemas
from tokenloop import LLM, SamplingParams
from tokenloop.structured import StructuredOutputsParams

pytestmark = [pytest.mark.real_model, pytest.mark.slow, requires_default_model]

SCHEMAS = generate_schemas(100)
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def llm(smollm2_checkpoint) -> LLM:
    return LLM(checkpoint=smollm2_checkpoint, max_num_seqs=64, max_num_batched_tokens=1024)


def prompt(llm: LLM, schema: dict) -> str:
    # Short, and the same up to the title: the prefix cache serves most of each prompt, so the run is
    # dominated by the constrained decode being tested, not by prefill.
    question = f"Reply with a short JSON value named {schema['title']}."
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": question}])


def check(llm: LLM, outputs, schemas) -> dict[str, int]:
    """Every stopped output validates; every cut one is a prefix the grammar accepts token by token."""
    finishes = {"stop": 0, "length": 0}
    for out, schema in zip(outputs, schemas):
        completion = out.outputs[0]
        finishes[completion.finish_reason] += 1
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), schema)
            continue
        assert completion.finish_reason == "length" and len(completion.token_ids) == MAX_TOKENS
        matcher = llm.engine.structured.compile(StructuredOutputsParams(json=schema)).new_matcher()
        assert all(matcher.accept(t) for t in completion.token_ids), completion.text
    return finishes


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_validates_batched_with_unconstrained_neighbours(llm: LLM, temperature: float) -> None:
    tokenizer = llm.get_tokenizer()
    plain_prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Say something about {t}."}])
                     for t in ("cats", "the sea", "trains", "bread")]
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(plain_prompts, plain, use_tqdm=False)]
    constrained = [SamplingParams(temperature=temperature, seed=i, max_tokens=MAX_TOKENS,
                                  structured_outputs=StructuredOutputsParams(json=s)) for i, s in enumerate(SCHEMAS)]
    outputs = llm.generate(plain_prompts + [prompt(llm, s) for s in SCHEMAS], [plain] * 4 + constrained,
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[:4]] == alone
    finishes = check(llm, outputs[4:], SCHEMAS)
    # Most schemas are small enough to finish; the rest end with "length" and a valid prefix.
    assert finishes["stop"] >= 80, finishes


def test_constrained_greedy_alone_equals_batched(smollm2_checkpoint) -> None:
    # Exact equality across batch shapes holds for fp32 weights (DESIGN: "exact on fp32"); the default dtype
    # picks bf16 or packed kernels whose rounding depends on how many rows share a step.
    llm = LLM(checkpoint=smollm2_checkpoint, max_num_seqs=64, max_num_batched_tokens=1024, dtype="float32")
    picked = SCHEMAS[:2]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=s))
              for s in picked]
    prompts = [prompt(llm, s) for s in picked]
    batched = llm.generate(prompts, params, use_tqdm=False)
    for p, q, together in zip(prompts, params, batched):
        assert llm.generate(p, q, use_tqdm=False)[0].outputs[0].token_ids == together.outputs[0].token_ids
