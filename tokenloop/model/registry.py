"""Architecture name -> model class: one line per family.

A GGUF names its family in `general.architecture`, a Hugging Face directory in config.json's `model_type`
(or, failing that, its `architectures` class names). Both resolve here, and nowhere else, to the class that
builds and runs the model. The class is named as "module:Class" and imported only when a model is built, so
reading a checkpoint's config (the front end, the CLI) stays free of torch. This room sits below the model
classes (the loader, which they reach, asks it for them), so it names them by `ModelFamily`, what a reader of
checkpoints asks of a family's class; the builder (`dtypes.build_model`) checks it has the whole model.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tokenloop.errors import UnsupportedModelError

if TYPE_CHECKING:
    import numpy as np

    from tokenloop.config import ModelConfig


class ModelFamily(Protocol):
    """A family's class as the loader reads checkpoints with it (models/llama.py's class methods)."""

    def tensor_names(self, config: ModelConfig) -> list[str]:
        """Every HF-named tensor a checkpoint of this family may hold."""
        ...

    def gguf_tensor(self, hf_name: str, array: np.ndarray) -> np.ndarray:
        """A GGUF's dense tensor as HF's checkpoint holds it."""
        ...


@dataclass(frozen=True)
class Architecture:
    """One supported family: its name, the class that runs it, and what its checkpoints look like."""

    name: str  # GGUF general.architecture and HF model_type
    model: str  # "module:Class"
    hf_classes: tuple[str, ...]  # HF config.json `architectures`
    gguf_names: str = ""  # the gguf package's MODEL_ARCH whose tensor names the files use ("": `name`)
    gguf_permutes_qk: bool = False  # llama.cpp's converter interleaves Q/K rows (llama-arch files only)
    # What llama.cpp assumes of a file of this family where its metadata is silent: every n-th layer global,
    # the others sliding (0: none), and the sliding layers' rotary base.
    gguf_sliding_pattern: int = 0
    gguf_sliding_rope_theta: float = 0.0
    # Where a GGUF names none: its chat template (a name in tokenizer/family_templates.py) and the token
    # text that ends a turn (an end-of-generation id besides eos).
    gguf_chat_template: str = ""
    gguf_end_of_turn: str = ""
    # Whether a GGUF of this mixture-of-experts family renormalizes the top-k router weights where its
    # metadata does not say (`expert_weights_norm`): llama.cpp's own choice per family.
    gguf_expert_weights_norm: bool = False

    @property
    def gguf_arch(self) -> str:
        return self.gguf_names or self.name


_LLAMA = "tokenloop.model.models.llama:LlamaModel"
_GEMMA3 = "tokenloop.model.models.gemma3:Gemma3Model"
_QWEN3_MOE = "tokenloop.model.models.qwen3_moe:Qwen3MoeModel"
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", _LLAMA, ("LlamaForCausalLM",), gguf_permutes_qk=True),
    Architecture("mistral", _LLAMA, ("MistralForCausalLM",), gguf_names="llama", gguf_permutes_qk=True),
    Architecture("qwen2", _LLAMA, ("Qwen2ForCausalLM",)),
    Architecture("qwen3", "tokenloop.model.models.qwen3:Qwen3Model", ("Qwen3ForCausalLM",)),
    Architecture("phi3", "tokenloop.model.models.phi3:Phi3Model", ("Phi3ForCausalLM",)),
    Architecture("gemma3", _GEMMA3, (), gguf_sliding_pattern=6, gguf_sliding_rope_theta=10000.0,
                 gguf_chat_template="gemma", gguf_end_of_turn="<end_of_turn>"),
    Architecture("gemma3_text", _GEMMA3, ("Gemma3ForCausalLM",), gguf_names="gemma3"),
    Architecture("olmoe", "tokenloop.model.models.olmoe:OlmoeModel", ("OlmoeForCausalLM",)),
    Architecture("qwen3moe", _QWEN3_MOE, (), gguf_expert_weights_norm=True),
    Architecture("qwen3_moe", _QWEN3_MOE, ("Qwen3MoeForCausalLM",), gguf_names="qwen3moe"),
)}


def supported() -> str:
    """The supported names, for error messages."""
    return ", ".join(ARCHITECTURES)


def architecture(name: Any, source: str, field: str = "architecture") -> Architecture:
    """The family called `name`, or UnsupportedModelError naming `source` and listing the supported ones."""
    found = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if found is None:
        raise UnsupportedModelError(f"{source}: {field} {name!r} is not supported ({supported()})")
    return found


def hf_architecture(raw_config: dict[str, Any], source: str) -> Architecture:
    """The family of an HF config.json: by `model_type`, or where it has none by its `architectures`."""
    model_type = raw_config.get("model_type")
    if model_type is not None:
        return architecture(model_type, source, field="model_type")
    for hf_class in raw_config.get("architectures") or ():
        for arch in ARCHITECTURES.values():
            if hf_class in arch.hf_classes:
                return arch
    return architecture(model_type, source, field="model_type")


def model_class(name: str) -> ModelFamily:
    """The class that builds and runs architecture `name` (imported now)."""
    module, _, cls = architecture(name, "model").model.partition(":")
    family: ModelFamily = getattr(importlib.import_module(module), cls)
    return family
