"""LoRA adapters: read from a PEFT directory or a llama.cpp GGUF LoRA and checked against the base model.

An adapter's output adds on top of its base projection's: `x @ A.T @ B.T * scaling`, with the scaling folded
into B. The model fuses Q/K/V and gate/up into one matrix each (models/llama.py LayerWeights); a resident
adapter is fused the same way when it is loaded into a slot (model/lora_slots.py): the sub-projections' A
matrices stacked, their B matrices block-diagonal (kept as the diagonal blocks alone), so one shrink and one
expand serve all of them.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tokenloop.config import ModelConfig
from tokenloop.errors import AdapterLoadError

# The projections an adapter may target, PEFT's module names, in the order their fused matrix stacks them.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_MODULE_PREFIX = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_PEFT_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                          r"\.lora_([AB])(?:\.default)?\.weight$")


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each projection an adapter may target, from the base model's config."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


@dataclass
class LoRAAdapter:
    """One adapter, checked against the base model.

    `layers[i][module]` is (A [rank, in], B [out, rank]) with the scaling in B, for each projection (q_proj,
    ...) the adapter adapts in layer i. Loading it into a slot (model/lora_slots.py) fuses them as the base
    model's projections are fused."""

    name: str
    path: str
    rank: int  # the adapter's own rank (before padding to the engine's max_lora_rank)
    scaling: float
    targets: tuple[str, ...]  # the projections it adapts (q_proj, ...)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    load_s: float = 0.0  # reading and checking, for the load-time figure

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())


# ---- reading: PEFT directory / GGUF LoRA ------------------------------------------------------------

def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read an adapter (a PEFT directory, or a GGUF LoRA file) for a base model of `config`; raises
    AdapterLoadError naming what is wrong (missing or corrupt files, another model's shapes, too high a
    rank)."""
    begin = time.perf_counter()
    location = Path(path)
    if location.is_dir():
        rank, scaling, tensors = _read_peft(location, config)
    elif location.is_file():
        rank, scaling, tensors = _read_gguf(location, config)
    else:
        raise AdapterLoadError(f"adapter {name!r}: {location} is neither a PEFT directory nor a GGUF file")
    if rank > max_rank:
        raise AdapterLoadError(f"adapter {name!r} has rank {rank}, above this server's max_lora_rank "
                               f"{max_rank}: raise --max-lora-rank to serve it")
    layers = _scaled(name, tensors, config, scaling, dtype)
    targets = tuple(sorted({module for _, module in tensors}))
    return LoRAAdapter(name, str(location), rank, scaling, targets, layers, time.perf_counter() - begin)


# (layer, module) -> (A [r, in], B [out, r])
Tensors = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _read_peft(directory: Path, config: ModelConfig) -> tuple[int, float, Tensors]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise AdapterLoadError(f"{directory}: no {needed.name} (a PEFT LoRA directory holds "
                                   "adapter_config.json and adapter_model.safetensors)")
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterLoadError(f"{config_file}: not valid JSON ({exc})") from exc
    if not isinstance(settings, dict):
        raise AdapterLoadError(f"{config_file}: expected a JSON object")
    _check_peft_settings(config_file, settings)
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise AdapterLoadError(f"{config_file}: r must be a positive integer and lora_alpha a number")
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    try:
        raw = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterLoadError(f"{weights_file}: cannot read safetensors ({exc})") from exc
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        match = _PEFT_TENSOR.match(key)
        if match is None:
            raise AdapterLoadError(f"{weights_file}: tensor {key!r} is not a LoRA A/B of a decoder layer's "
                                   "q/k/v/o/gate/up/down projection")
        layer, prefix, module, half = int(match[1]), match[2], match[3], match[4]
        if _MODULE_PREFIX.get(module) != prefix:
            raise AdapterLoadError(f"{weights_file}: tensor {key!r} targets {prefix}.{module}, which "
                                   "this engine does not adapt (q/k/v/o/gate/up/down projections only)")
        halves.setdefault((layer, module), {})[half] = tensor
    return rank, scaling, _pairs(str(weights_file), halves, config, rank)


def _check_peft_settings(config_file: Path, settings: dict) -> None:
    """Refuse the PEFT options whose arithmetic this engine does not run, rather than serve them wrong."""
    refused = [("use_dora", bool(settings.get("use_dora"))),
               ("bias", settings.get("bias", "none") not in (None, "none")),
               ("modules_to_save", bool(settings.get("modules_to_save"))),
               ("rank_pattern", bool(settings.get("rank_pattern"))),
               ("alpha_pattern", bool(settings.get("alpha_pattern"))),
               ("fan_in_fan_out", bool(settings.get("fan_in_fan_out")))]
    for option, used in refused:
        if used:
            raise AdapterLoadError(f"{config_file}: {option} is not supported by this engine's LoRA")
    if settings.get("peft_type", "LORA") != "LORA":
        raise AdapterLoadError(f"{config_file}: peft_type {settings.get('peft_type')!r} is not LORA")


def _read_gguf(file: Path, config: ModelConfig) -> tuple[int, float, Tensors]:
    from tokenloop.errors import ModelLoadError
    from tokenloop.model import registry
    from tokenloop.model.gguf_file import GGUFFile
    from tokenloop.model.loader import rope_row_order
    from tokenloop.model.weights import gguf_to_hf_names

    try:
        gguf = GGUFFile(file)
    except ModelLoadError as exc:
        raise AdapterLoadError(str(exc)) from exc
    meta = gguf.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type", "lora") != "lora":
        raise AdapterLoadError(f"{file}: not a GGUF LoRA adapter (general.type = "
                               f"{meta.get('general.type')!r}, expected 'adapter' with adapter.type 'lora')")
    arch = meta.get("general.architecture")
    base_arch = registry.architecture(config.architecture, str(file))
    if arch != base_arch.gguf_arch:
        raise AdapterLoadError(f"{file}: an adapter for a {arch!r} model; the base model is "
                               f"{base_arch.gguf_arch!r}")
    hf_modules = [f"model.layers.{i}.{_MODULE_PREFIX[m]}.{m}.weight"
                  for i in range(config.num_layers) for m in _MODULE_PREFIX]
    names = gguf_to_hf_names(arch, config.num_layers, hf_modules)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        for tensor_name, info in gguf.tensors.items():
            base_name, _, half = tensor_name.rpartition(".lora_")
            hf_name = names.get(base_name)
            if hf_name is None or half not in ("a", "b"):
                raise AdapterLoadError(f"{file}: tensor {tensor_name!r} is not a LoRA A/B of a decoder "
                                       "layer's q/k/v/o/gate/up/down projection")
            array = gguf.load(tensor_name)
            order = rope_row_order(base_name, info.shape[0], config) if half == "b" else None
            if order is not None and array.shape[0] == len(order):
                array = array[order]  # llama.cpp's converter interleaved B's Q/K rows, as it does the base's
            parts = hf_name.split(".")
            halves.setdefault((int(parts[2]), parts[4]), {})[half.upper()] = torch.from_numpy(
                np.ascontiguousarray(array))
    finally:
        gguf.close()
    if not halves:
        raise AdapterLoadError(f"{file}: the adapter holds no LoRA tensors")
    alpha = meta.get("adapter.lora.alpha")
    rank = int(next(iter(halves.values())).get("A", torch.empty(0, 0)).shape[0])
    if not isinstance(alpha, (int, float)) or rank < 1:
        raise AdapterLoadError(f"{file}: adapter.lora.alpha is missing or the rank cannot be read")
    return rank, float(alpha) / rank, _pairs(str(file), halves, config, rank)


def _pairs(where: str, halves: dict[tuple[int, str], dict[str, torch.Tensor]], config: ModelConfig,
           rank: int) -> Tensors:
    """Each (layer, module)'s (A, B), checked against the base model's shapes and the adapter's rank."""
    shapes = projection_shapes(config)
    pairs: Tensors = {}
    for (layer, module), found in sorted(halves.items()):
        label = f"{where}: layer {layer} {module}"
        if "A" not in found or "B" not in found:
            raise AdapterLoadError(f"{label}: has lora_{'A' if 'A' not in found else 'B'} missing")
        if layer >= config.num_layers:
            raise AdapterLoadError(f"{label}: the base model has only {config.num_layers} layers "
                                   "(an adapter of another base model?)")
        if config.num_experts and module in ("gate_proj", "up_proj", "down_proj"):
            raise AdapterLoadError(f"{label}: the base model's MLP is a mixture of experts; adapters on "
                                   "experts are not supported (attention projections only)")
        a, b = found["A"], found["B"]
        out_features, in_features = shapes[module]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise AdapterLoadError(f"{label}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base "
                                   f"model's {out_features}x{in_features} projection at rank {rank} "
                                   "(an adapter of another base model?)")
        pairs[(layer, module)] = (a.float(), b.float())
    return pairs


def _scaled(name: str, tensors: Tensors, config: ModelConfig, scaling: float,
            dtype: torch.dtype) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer, per adapted projection: (A [r, in], B * scaling [out, r]) in `dtype`, checked finite.

    The matrices of one shape are stacked and converted together, in numpy: a few single-threaded passes for
    the whole adapter instead of three torch ops per matrix (840 for a rank-16 adapter of the default model),
    and no multi-threaded op whose threads wait for each other on a busy machine (~40 ms an op there)."""
    if not tensors:
        raise AdapterLoadError(f"adapter {name!r} adapts no projection")
    by_shape: dict[tuple[int, tuple[int, ...]], list[tuple[int, str]]] = {}
    for key, pair in tensors.items():
        for half, matrix in enumerate(pair):
            by_shape.setdefault((half, tuple(matrix.shape)), []).append(key)
    converted: dict[tuple[int, tuple[int, str]], torch.Tensor] = {}
    for (half, _), keys in by_shape.items():
        stacked = np.stack([tensors[key][half].numpy() for key in keys])
        if not np.isfinite(stacked).all():
            layer, module = next(key for key in keys if not torch.isfinite(tensors[key][half]).all())
            raise AdapterLoadError(f"adapter {name!r}: layer {layer} {module}: holds NaN or infinite values")
        if half == 1:
            stacked *= np.float32(scaling)
        for key, matrix in zip(keys, _to_dtype(stacked, dtype).unbind(0)):
            converted[half, key] = matrix
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(config.num_layers)]
    for index, module in tensors:
        layers[index][module] = (converted[0, (index, module)], converted[1, (index, module)])
    return layers


def _to_dtype(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float32 `values` (overwritten) as a tensor of `dtype`; bf16 rounded to nearest even, as torch does
    for finite values, in numpy (which has no bf16 type)."""
    if dtype != torch.bfloat16:
        return torch.from_numpy(values).to(dtype)
    bits = values.view(np.uint32)
    bits += np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return torch.from_numpy((bits >> np.uint32(16)).astype(np.uint16)).view(torch.bfloat16)
