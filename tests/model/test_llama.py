"""The model over the paged cache against HF transformers: greedy tokens and mixed-batch logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import requires_default_model, write_tiny_llama
from tests.model.paged_harness import PagedHarness, Sequence
from tokenloop.model.loader import load_checkpoint
from tokenloop.model.models.llama import LlamaModel


def _hf_last_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0, -1].float()


def _assert_relative_close(ours: torch.Tensor, ref: torch.Tensor, tolerance: float = 1e-4) -> None:
    error = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert error <= tolerance, f"max |diff| / max |ref| = {error:.2e} > {tolerance}"


def _mixed_step_logits(model: LlamaModel, prompts: list[list[int]], block_size: int) -> list[torch.Tensor]:
    """One flat step mixing four kinds of work; returns the last-position logits of prompts[0..3].

    prompts[0]: whole prompt in the final step; prompts[1]: fed in chunks of 7 over earlier steps,
    last chunk in the final step; prompts[2]: reuses the K/V that prompts[4] (computed earlier)
    wrote for their shared prefix; prompts[3]: all but its last token earlier, last token (decode)
    in the final step.
    """
    harness = PagedHarness(model, num_blocks=128, block_size=block_size)
    whole, chunked, reuser, decoder, donor = (Sequence(list(p)) for p in prompts)
    harness.step([(donor, len(donor.token_ids))])
    shared_blocks = 2
    harness.share_prefix(donor, reuser, shared_blocks)
    harness.step([(decoder, len(decoder.token_ids) - 1)])
    while len(chunked.token_ids) - chunked.num_computed > 7:
        harness.step([(chunked, 7)])
    logits = harness.step([
        (whole, len(whole.token_ids)),
        (chunked, len(chunked.token_ids) - chunked.num_computed),
        (reuser, len(reuser.token_ids) - reuser.num_computed),
        (decoder, 1),
    ])
    return list(logits)


def _prompts(vocab: int, seed: int, shared_prefix: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(vocab, (shared_prefix,), generator=gen).tolist()

    def rand(n: int) -> list[int]:
        return torch.randint(vocab, (n,), generator=gen).tolist()

    return [rand(23), rand(40), prefix + rand(9), rand(30), prefix + rand(5)]


def test_tiny_model_mixed_step_matches_hf(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint = load_checkpoint(str(tiny_model_dir))
    model = LlamaModel.from_weights(checkpoint.config, checkpoint.weights)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    block_size = 4
    prompts = _prompts(checkpoint.config.vocab_size, seed=1, shared_prefix=2 * block_size)
    for ours, prompt in zip(_mixed_step_logits(model, prompts, block_size), prompts):
        _assert_relative_close(ours, _hf_last_logits(hf, prompt))


@pytest.mark.parametrize("variant", ["llama3-rope", "linear-rope", "qwen2-bias"])
def test_tiny_variants_match_hf(tmp_path: Path, variant: str) -> None:
    """RoPE scaling and Qwen2's QKV bias, each against HF's own implementation."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    write_tiny_llama(tmp_path, seed=3)
    config = json.loads((tmp_path / "config.json").read_text())
    if variant == "llama3-rope":
        config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    elif variant == "linear-rope":
        config["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    else:
        config["model_type"], config["architectures"] = "qwen2", ["Qwen2ForCausalLM"]
        weights = load_file(str(tmp_path / "model.safetensors"))
        gen = torch.Generator().manual_seed(5)
        for i in range(config["num_hidden_layers"]):
            for name, size in (("q", 64), ("k", 32), ("v", 32)):
                weights[f"model.layers.{i}.self_attn.{name}_proj.bias"] = torch.randn(size, generator=gen) * 0.5
        save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))

    checkpoint = load_checkpoint(str(tmp_path))
    model = LlamaModel.from_weights(checkpoint.config, checkpoint.weights)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    prompt = torch.randint(checkpoint.config.vocab_size, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    harness = PagedHarness(model, block_size=8)
    seq = Sequence(prompt)
    harness.step([(seq, 100)])
    ours = harness.step([(seq, 50)])[0]
    _assert_relative_close(ours, _hf_last_logits(hf, prompt))


@requires_default_model
def test_default_model_greedy_matches_hf(smollm2_checkpoint, hf_smollm2) -> None:
    """"The capital of France is", greedy until EOS or 32 tokens: identical token ids."""
    tokenizer = smollm2_checkpoint.tokenizer
    prompt = tokenizer.encode("The capital of France is")
    with torch.inference_mode():
        reference = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    expected = reference[0, len(prompt):].tolist()

    model = LlamaModel.from_weights(smollm2_checkpoint.config, smollm2_checkpoint.weights)
    harness = PagedHarness(model)
    seq = Sequence(list(prompt))
    generated: list[int] = []
    logits = harness.step([(seq, len(prompt))])
    while True:
        token = int(logits[0].argmax())
        generated.append(token)
        seq.token_ids.append(token)
        if token == tokenizer.eos_token_id or len(generated) == 32:
            break
        logits = harness.step([(seq, 1)])
    assert generated == expected


@requires_default_model
def test_default_model_mixed_step_logits_match_hf(smollm2_checkpoint, hf_smollm2) -> None:
    model = LlamaModel.from_weights(smollm2_checkpoint.config, smollm2_checkpoint.weights)
    prompts = _prompts(smollm2_checkpoint.config.vocab_size, seed=0, shared_prefix=32)
    for ours, prompt in zip(_mixed_step_logits(model, prompts, block_size=16), prompts):
        _assert_relative_close(ours, _hf_last_logits(hf_smollm2, prompt))


def test_bf16_weights_with_fp32_activations_stay_close(tiny_model_dir: Path) -> None:
    """weight_dtype=bfloat16 keeps the residual stream, attention and KV cache in fp32: logits move by
    about bf16's precision, not more."""
    checkpoint = load_checkpoint(str(tiny_model_dir))
    full = LlamaModel.from_weights(checkpoint.config, checkpoint.weights)
    narrow = LlamaModel.from_weights(checkpoint.config, checkpoint.weights, weight_dtype=torch.bfloat16)
    assert narrow.layers[0].qkv.dtype == torch.bfloat16 and narrow.kv_bytes_per_block(16) == full.kv_bytes_per_block(16)
    prompt = torch.randint(checkpoint.config.vocab_size, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    ours = PagedHarness(narrow, block_size=8).step([(Sequence(prompt), 40)])[0]
    reference = PagedHarness(full, block_size=8).step([(Sequence(prompt), 40)])[0]
    _assert_relative_close(ours, reference, tolerance=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_is_zeroed_writable_and_one_tensor_per_layer_and_side(tiny_model_dir: Path,
                                                                       dtype: torch.dtype) -> None:
    checkpoint = load_checkpoint(str(tiny_model_dir))
    model = LlamaModel.from_weights(checkpoint.config, checkpoint.weights, kv_dtype=dtype)
    caches = model.allocate_kv_cache(num_blocks=7, block_size=4)
    config = model.config
    assert len(caches) == config.num_layers
    pointers = set()
    for key, value in caches:
        for cache in (key, value):
            assert cache.shape == (7, 4, config.num_kv_heads, config.head_dim) and cache.dtype == dtype
            assert cache.is_contiguous() and not cache.any()
            pointers.add(cache.data_ptr())
    assert len(pointers) == 2 * config.num_layers  # no two share memory
    caches[0][1][3, 2] = 1.5  # written in place, as write_kv does; nothing else moves
    assert caches[0][1][3, 2].eq(1.5).all() and not caches[0][0].any() and not caches[1][1].any()
