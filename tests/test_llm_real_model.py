"""The offline API on the real default model: HF parity and batch invariance."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import requires_default_model
from tokenloop import LLM, SamplingParams

pytestmark = requires_default_model


@pytest.fixture(scope="module")
def llm(smollm2_checkpoint) -> LLM:
    # float32: HF parity and exact batch invariance are fp32 properties (dtype auto: tests/model/test_quantized*).
    return LLM(checkpoint=smollm2_checkpoint, max_num_seqs=32, max_num_batched_tokens=256, dtype="float32")


def test_generate_greedy_equals_hf(llm: LLM, hf_smollm2) -> None:
    tokenizer = llm.get_tokenizer()
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    with torch.inference_mode():
        reference = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    expected = reference[0, len(ids):].tolist()
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].text == tokenizer.decode(expected)


def test_sixteen_mixed_requests_batched_equal_one_at_a_time(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    topics = ["the sea", "a cat", "trains", "the moon", "bread", "rain", "chess", "music"]
    prompts = [f"Write one sentence about {t}." for t in topics]
    prompts += [tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me a fact about {t}."}])
                for t in topics]
    prompts[3] = prompts[3] * 12  # one long prompt, prefilled in chunks next to decodes
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 2 * (i % 5)) for i in range(16)]
    batched = llm.generate(prompts, params, use_tqdm=False)
    for prompt, param, together in zip(prompts, params, batched):
        alone = llm.generate(prompt, param, use_tqdm=False)[0]
        assert together.outputs[0].token_ids == alone.outputs[0].token_ids, prompt[:40]
