"""A checkpoint's own description -> `ModelConfig`: a GGUF file's metadata, or an HF directory's config.json.

Each format names the same facts its own way (head counts, rotary base and scaling, which layers slide, the
experts); this room reads them into the one `ModelConfig` the model is built from, and fails with
`ModelLoadError` naming the file and the key where one is missing or bad. The family (model/registry.py) fills
in what llama.cpp assumes where a GGUF's metadata is silent. Standard library and numpy only: reading a
config stays free of torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tokenloop.config import ModelConfig, RopeScaling
from tokenloop.errors import ConfigError, ModelLoadError, UnsupportedModelError
from tokenloop.model import registry
from tokenloop.model.gguf_file import GGUFFile

# -- GGUF ---------------------------------------------------------------------------------------


def gguf_config(gguf: GGUFFile) -> ModelConfig:
    """The model a GGUF file describes, from its metadata (and the names of the tensors it holds)."""
    meta = gguf.metadata
    family = registry.architecture(meta.get("general.architecture"), str(gguf.path))
    arch = family.name

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{gguf.path}: metadata key {arch}.{key} is missing")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    # The rotary dims: a whole head, or fewer where only part of it rotates (Phi-3's converter writes them
    # and no key_length); a head wider than hidden / heads states its width in one key or the other.
    rotary_dims = int(meta.get(f"{arch}.rope.dimension_count") or 0)
    head_dim = int(meta.get(f"{arch}.attention.key_length") or max(rotary_dims, hidden // num_heads))
    rope_scaling = _gguf_rope_scaling(gguf, arch, get)
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens", []))
    num_layers = int(get("block_count"))
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    sliding = _gguf_sliding_layers(meta, arch, family, window, num_layers)
    # An attention scale other than head_dim ** -0.5 where the file states one (llama.cpp's Gemma 3 loader
    # assumes head_dim, and hidden / heads for the 27B shape, which no file states).
    scale = float(meta.get(f"{arch}.attention.scale") or 0.0)
    num_experts = int(meta.get(f"{arch}.expert_count") or 0)
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in gguf.tensors,
            attention_bias="blk.0.attn_q.bias" in gguf.tensors,
            layer_types=layer_types(sliding) if any(sliding) else (),
            sliding_window=window if any(sliding) else 0,
            rope_local_theta=float(meta.get(f"{arch}.rope.freq_base_swa", family.gguf_sliding_rope_theta)),
            query_pre_attn_scalar=scale ** -2 if scale > 0 else 0.0,
            num_experts=num_experts,
            num_experts_per_tok=int(meta.get(f"{arch}.expert_used_count") or 0),
            # OLMoE's files give the experts' width as the feed-forward length; Qwen3-MoE's under its own key.
            expert_intermediate_size=int(meta.get(f"{arch}.expert_feed_forward_length")
                                         or get("feed_forward_length")) if num_experts else 0,
            norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", family.gguf_expert_weights_norm)),
            partial_rotary_factor=rotary_dims / head_dim if 0 < rotary_dims < head_dim else 1.0,
        )
    except ConfigError as exc:
        raise ModelLoadError(f"{gguf.path}: {exc}") from exc


def _gguf_rope_scaling(gguf: GGUFFile, arch: str, get: Callable[..., Any]) -> RopeScaling:
    """The rotary scaling a GGUF states: none, linear, or LongRoPE (whose factors the converter writes as
    tensors)."""
    meta = gguf.metadata
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if "rope_factors_long.weight" in gguf.tensors:
        return RopeScaling(
            "longrope", original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
            long_factor=tuple(gguf.load("rope_factors_long.weight").tolist()),
            short_factor=tuple(gguf.load("rope_factors_short.weight").tolist()),
            attention_factor=float(meta.get(f"{arch}.rope.scaling.attn_factor") or 0.0))
    if scaling_type in ("none", None):
        return RopeScaling()
    if scaling_type == "linear":
        return RopeScaling("linear", float(get("rope.scaling.factor")))
    raise UnsupportedModelError(f"{gguf.path}: rope scaling {scaling_type!r} is not supported")


def _gguf_sliding_layers(meta: dict[str, Any], arch: str, family: registry.Architecture, window: int,
                         num_layers: int) -> list[bool]:
    """Which layers slide: the file's per-layer flags, or the family's fixed interleave llama.cpp assumes."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", family.gguf_sliding_pattern)
    if not window:
        return [False] * num_layers
    if isinstance(pattern, (int, np.integer)):
        return [bool(pattern > 0 and i % pattern < pattern - 1) for i in range(num_layers)]
    return [bool(flag) for flag in pattern]


def layer_types(sliding: list[bool]) -> tuple[str, ...]:
    """HF's per-layer attention kinds for these sliding flags."""
    return tuple("sliding_attention" if s else "full_attention" for s in sliding)


# -- Hugging Face directory ----------------------------------------------------------------------

def hf_config(path: Path) -> ModelConfig:
    """The model an HF checkpoint directory describes, from its config.json."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json in the checkpoint directory")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file}: invalid JSON ({exc})") from exc
    arch = registry.hf_architecture(raw, str(config_file)).name
    try:
        return _hf_model_config(raw, arch, config_file)
    except KeyError as exc:
        raise ModelLoadError(f"{config_file}: missing field {exc.args[0]!r}") from exc
    except ConfigError as exc:
        raise ModelLoadError(f"{config_file}: {exc}") from exc


def _hf_model_config(raw: dict[str, Any], arch: str, config_file: Path) -> ModelConfig:
    """config.json's fields as a `ModelConfig` (a missing required field raises KeyError)."""
    theta, rope_scaling, rope_raw, local_raw = _hf_rope(raw)
    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    kinds = _hf_layer_types(raw, int(raw["num_hidden_layers"]))
    sliding = "sliding_attention" in kinds
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if num_experts and (raw.get("mlp_only_layers") or int(raw.get("decoder_sparse_step") or 1) != 1):
        raise UnsupportedModelError(f"{config_file}: dense MLP layers between expert layers "
                                    "(mlp_only_layers, decoder_sparse_step) are not supported")
    if raw.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"{config_file}: clip_qkv is not supported")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        partial_rotary_factor=float(rope_raw.get("partial_rotary_factor")
                                    or raw.get("partial_rotary_factor") or 1.0),
        layer_types=kinds if sliding else (),
        sliding_window=int(raw.get("sliding_window") or 0) if sliding else 0,
        rope_local_theta=float(local_raw.get("rope_theta", raw.get("rope_local_base_freq") or 0.0)),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 0.0),
        num_experts=num_experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0) if num_experts else 0,
        expert_intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"])
        if num_experts else 0,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )


def _hf_rope(raw: dict[str, Any]) -> tuple[Any, RopeScaling, dict[str, Any], dict[str, Any]]:
    """The rotary base, its scaling, and the raw rope fields of the full and the sliding layers."""
    # transformers >= 5 writes theta and scaling together as `rope_parameters`; older files, `rope_theta` and
    # `rope_scaling` apart.
    rope_raw = raw.get("rope_parameters") or {}
    local_raw: dict[str, Any] = {}
    if "full_attention" in rope_raw:  # one set per layer kind (transformers >= 5, Gemma 3)
        rope_raw, local_raw = rope_raw["full_attention"] or {}, rope_raw.get("sliding_attention") or {}
    theta = rope_raw.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling_raw = raw.get("rope_scaling") or {k: v for k, v in rope_raw.items()
                                              if k not in ("rope_theta", "partial_rotary_factor")}
    scaling_type = scaling_raw.get("rope_type", scaling_raw.get("type", "default"))
    if scaling_type == "default":
        scaling_raw = {}
    rope_scaling = RopeScaling(
        rope_type=scaling_type,
        factor=float(scaling_raw.get("factor") or 1.0),
        low_freq_factor=float(scaling_raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling_raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling_raw.get("original_max_position_embeddings")
                                             or raw.get("original_max_position_embeddings") or 8192),
        long_factor=tuple(float(x) for x in scaling_raw.get("long_factor") or ()),
        short_factor=tuple(float(x) for x in scaling_raw.get("short_factor") or ()),
        attention_factor=float(scaling_raw.get("attention_factor") or 0.0),
    ) if scaling_raw else RopeScaling()
    return theta, rope_scaling, rope_raw, local_raw


def _hf_layer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Each layer's attention kind as config.json states it; older Gemma 3 configs say only "every n-th layer
    global"."""
    kinds = tuple(raw.get("layer_types") or ())
    pattern = int(raw.get("sliding_window_pattern") or 0)
    if not kinds and pattern and raw.get("sliding_window"):
        kinds = layer_types([(i + 1) % pattern != 0 for i in range(num_layers)])
    return kinds
