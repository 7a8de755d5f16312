"""The default Q4_1 model run on its packed weights agrees with the fp32 (dequantized) model."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import requires_default_model
from tests.model.paged_harness import PagedHarness, Sequence
from tokenloop.bench.datasets import AGREEMENT_PROMPTS
from tokenloop.model.attention import AttentionMetadata
from tokenloop.model.int8_dot import int8_dot_available
from tokenloop.model.loader import load_checkpoint
from tokenloop.model.models.llama import LlamaModel
from tokenloop.model.quantized import PackedLinear, PackThresholds

pytestmark = [requires_default_model, pytest.mark.real_model]

PROMPTS = AGREEMENT_PROMPTS
NEW_TOKENS = 64
INT4_FORMS = ("int4", "int4_vnni")  # torch's kernel; our int8-dot kernel where it runs natively


def _greedy_batched(model: LlamaModel, prompts: list[list[int]]) -> list[list[int]]:
    """NEW_TOKENS greedy tokens for every prompt, all decoded together."""
    harness = PagedHarness(model, num_blocks=512)
    seqs = [Sequence(list(p)) for p in prompts]
    logits = harness.step([(s, len(s.token_ids)) for s in seqs])
    for _ in range(NEW_TOKENS):
        for seq, row in zip(seqs, logits):
            seq.token_ids.append(int(row.argmax()))
        if len(seqs[0].token_ids) - len(prompts[0]) == NEW_TOKENS:
            break
        logits = harness.step([(s, 1) for s in seqs])
    return [s.token_ids[len(p):] for s, p in zip(seqs, prompts)]


def _teacher_forced_top1(model: LlamaModel, prompt: list[int], continuation: list[int]) -> list[int]:
    """The model's argmax at each continuation position, fed the reference tokens (one prefill)."""
    tokens = prompt + continuation
    n = len(tokens)
    kv = model.allocate_kv_cache((n + 15) // 16, 16)
    meta = AttentionMetadata.build([0, n], [n], torch.arange((n + 15) // 16)[None], torch.arange(n), 16,
                                   model.decode_kernel)
    rows = torch.arange(len(prompt) - 1, n - 1)
    with torch.inference_mode():
        logits = model.forward(torch.tensor(tokens), torch.arange(n), meta, kv, rows)
    return logits.argmax(-1).tolist()


@pytest.fixture(scope="module")
def fp32_reference(smollm2_checkpoint) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts' token ids and the fp32 model's (fp32 weights and KV cache) NEW_TOKENS greedy tokens."""
    tokenizer = smollm2_checkpoint.tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    reference = LlamaModel.from_weights(smollm2_checkpoint.config, smollm2_checkpoint.weights)
    return prompts, _greedy_batched(reference, prompts)


def test_packed_model_top1_agrees_with_fp32(fp32_reference) -> None:
    """20 prompts x 64 greedy fp32 tokens, teacher-forced: >= 98% top-1 agreement, for the int4 / Q8_0 kernels
    (forced for every row count) and for the per-batch-size choice (large prefills run the bf16 copy), with our
    int8-dot kernels where they run natively and with torch's int4 and our fp32 Q8_0 kernel."""
    kept = load_checkpoint("smollm2-135m-instruct", keep_quantized=True)
    prompts, continuations = fp32_reference
    total = len(prompts) * NEW_TOKENS
    for thresholds in (PackThresholds.always_packed(), PackThresholds(), PackThresholds(int8_dot=False)):
        model = LlamaModel.from_weights(kept.config, kept.weights, quantized=True, thresholds=thresholds)
        assert isinstance(model.layers[0].gate_up, PackedLinear) and model.layers[0].gate_up.form in INT4_FORMS
        agree = sum(a == b for prompt, cont in zip(prompts, continuations)
                    for a, b in zip(_teacher_forced_top1(model, prompt, cont), cont))
        assert agree / total >= 0.98, f"{thresholds}: top-1 agreement {agree}/{total}"


def _teacher_forced_decode_top1(model: LlamaModel, prompts: list[list[int]],
                                continuations: list[list[int]]) -> list[list[int]]:
    """The model's argmax at each continuation position, fed the reference tokens one decode step at a time,
    all prompts batched: the decode kernel reads every earlier token's K/V back from the cache."""
    harness = PagedHarness(model, num_blocks=512)
    seqs = [Sequence(p + c) for p, c in zip(prompts, continuations)]
    logits = harness.step([(s, len(p)) for s, p in zip(seqs, prompts)])
    tops = [[int(row.argmax())] for row in logits]
    for _ in range(NEW_TOKENS - 1):
        for top, row in zip(tops, harness.step([(s, 1) for s in seqs])):
            top.append(int(row.argmax()))
    return tops


def test_bf16_kv_cache_top1_agrees_with_fp32(smollm2_checkpoint, fp32_reference) -> None:
    """A bf16 KV cache (fp32 activations and sums), with fp32 weights and with the default packed weights:
    >= 98% teacher-forced top-1 agreement with the fp32 model, through one prefill (attention over this
    step's K/V as cached) and through decode steps (the decode kernel over the bf16 cache); and with fp32
    weights, most prompts' greedy tokens are the fp32 KV cache's."""
    kept = load_checkpoint("smollm2-135m-instruct", keep_quantized=True)
    prompts, continuations = fp32_reference
    total = len(prompts) * NEW_TOKENS
    dense = LlamaModel.from_weights(smollm2_checkpoint.config, smollm2_checkpoint.weights, kv_dtype=torch.bfloat16)
    packed = LlamaModel.from_weights(kept.config, kept.weights, quantized=True, kv_dtype=torch.bfloat16)
    for name, model in (("fp32 weights", dense), ("packed weights", packed)):
        assert model.allocate_kv_cache(1, 16)[0][0].dtype == torch.bfloat16
        prefill = [_teacher_forced_top1(model, prompt, cont) for prompt, cont in zip(prompts, continuations)]
        decoded = _teacher_forced_decode_top1(model, prompts, continuations)
        for path, tops in (("prefill", prefill), ("decode", decoded)):
            agree = sum(a == b for top, cont in zip(tops, continuations) for a, b in zip(top, cont))
            assert agree / total >= 0.98, f"{name}, {path}: top-1 agreement {agree}/{total}"
    same = sum(got == want for got, want in zip(_greedy_batched(dense, prompts), continuations))
    assert same >= len(prompts) // 2, f"only {same} of {len(prompts)} prompts decode the same greedy tokens"


def test_default_engine_serves_the_packed_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """`LLM()` with dtype auto on a CPU with native bf16 keeps the Q4_1 file packed, runs a short prompt's
    steps in int4 and a long prefill in bf16, and says so."""
    from tokenloop import LLM, SamplingParams
    from tokenloop.model.dtypes import CpuFeatures

    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls: CpuFeatures(avx512_bf16=True)))
    llm = LLM(max_num_batched_tokens=256)
    assert llm.engine.dtype_choice.weights == "quantized"
    model = llm.engine.model
    layer_form, head_form = ("int4_vnni", "q8_0_vnni") if int8_dot_available() else ("int4", "q8_0")
    assert model.layers[0].gate_up.form == layer_form and model.lm_head.weight.form == head_form
    params = SamplingParams(temperature=0.0, max_tokens=8)
    out = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text and llm.engine.runner.last_weight_form == layer_form
    forms = []
    original = llm.engine.runner.execute

    def recording(output):  # SchedulerOutput -> RunnerOutput
        result = original(output)
        forms.append(result.weight_form)
        return result

    monkeypatch.setattr(llm.engine.runner, "execute", recording)
    llm.generate("Tell me a story. " * 20, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert forms[0] == "bfloat16" and forms[-1] == layer_form  # the 100-token prefill, then a decode step
