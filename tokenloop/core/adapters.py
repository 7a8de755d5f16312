"""The engine core's LoRA stage: which adapters this engine serves, loading and unloading them by name.

The adapters themselves (read, checked, fused) are the model side's (model/lora.py), their resident slots and
a step's products too (model/lora_slots.py); this stage decides what may be loaded (paths under the operator's
`lora_dir` at run time), names adapters in errors the client can act on, and finds the requests an unload
ends.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tokenloop.config import LoRAConfig
from tokenloop.errors import AdapterLoadError, AdapterNotFoundError, ConfigError
from tokenloop.model.dtypes import DtypeChoice
from tokenloop.model.lora import LoRAAdapter, load_adapter
from tokenloop.model.lora_slots import AdapterSlots
from tokenloop.model.models.llama import LlamaModel

logger = logging.getLogger(__name__)


def adapter_dtype(choice: DtypeChoice | None, requested: str = "auto") -> torch.dtype:
    """The adapters' slot dtype: the projections' where dense fp32 / bf16 (so fp32 models keep fp32 adapters),
    else the large-batch copy's (bf16 where the CPU has native bf16 dot products); with `requested` "auto" or
    "int8" and a packed (quantized) base, int8 with row scales: a decode step streams every used slot's A and B
    from memory, and int8 halves bf16's bytes (8 streams x 8 adapters: 78 MB a step in bf16)."""
    if choice is None:
        return torch.float32
    if requested in ("auto", "int8") and choice.weights == "quantized":
        return torch.int8
    form = choice.weights if choice.weights in ("float32", "bfloat16") else choice.dense_copy
    if choice.weights == "float16":
        form = "float32"
    return torch.bfloat16 if form == "bfloat16" else torch.float32


class AdapterStage:
    """The adapters one engine serves (`--lora NAME=PATH`, and at run time from `lora_dir`)."""

    def __init__(self, config: LoRAConfig, model: LlamaModel, dtype: torch.dtype) -> None:
        if type(model).decoder_layers is not LlamaModel.decoder_layers:
            raise ConfigError(f"LoRA adapters run on Llama-family layers; {model.config.architecture} "
                              "has its own")
        self.config = config
        self.model_config = model.config
        self.slots = AdapterSlots(model.config, config.max_loras, config.max_lora_rank, dtype, model.device)
        # int8 slots: each adapter is registered in bf16 and quantized once then (AdapterSlots.register).
        self.host_dtype = torch.bfloat16 if dtype == torch.int8 else dtype
        for name, path in config.adapters:
            self.load(name, path, at_start=True)

    @property
    def names(self) -> list[str]:
        return list(self.slots.registered)

    def describe(self) -> list[dict[str, object]]:
        """Each served adapter: name, path, rank, targets, load time (for /v1/models and the CLI)."""
        return [{"name": a.name, "path": a.path, "rank": a.rank, "scaling": a.scaling,
                 "targets": list(a.targets), "load_ms": round(a.load_s * 1e3, 2),
                 "resident": a.name in self.slots.resident}
                for a in self.slots.registered.values()]

    def require(self, name: str) -> None:
        """Raise AdapterNotFoundError (HTTP 404, model_not_found) for a name this engine does not serve."""
        if name not in self.slots.registered:
            raise AdapterNotFoundError(f"The model {name!r} does not exist: no LoRA adapter of that name is "
                                       "loaded", param="model")

    def load(self, name: str, path: str, at_start: bool = False) -> LoRAAdapter:
        """Read and serve an adapter; at run time only from under `lora_dir` and under a new name."""
        if not at_start:
            allowed = self.config.lora_dir
            if allowed is None:
                raise AdapterLoadError("loading LoRA adapters at run time is off: start the server with "
                                       "--lora-dir DIR to allow it from DIR")
            resolved, root = Path(path).resolve(), Path(allowed).resolve()
            if not resolved.is_relative_to(root):
                raise AdapterLoadError(f"{path} is not under the allowed LoRA directory {allowed}")
            if name in self.slots.registered:
                raise AdapterLoadError(f"a LoRA adapter named {name!r} is already loaded: unload it first")
        adapter = load_adapter(name, path, self.model_config, self.config.max_lora_rank, self.host_dtype)
        self.slots.register(adapter)
        logger.info("LoRA adapter %s loaded from %s (rank %d, %.1f ms)", name, path, adapter.rank,
                    adapter.load_s * 1e3)
        return adapter

    def unload(self, name: str) -> None:
        self.require(name)
        self.slots.unregister(name)
        logger.info("LoRA adapter %s unloaded", name)
