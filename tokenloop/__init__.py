"""tokenloop: a small LLM serving engine.

    from tokenloop import LLM, SamplingParams
    llm = LLM()  # the default model, SmolLM2-135M-Instruct
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenloop.config import CacheConfig, EngineConfig, SchedulerConfig
    from tokenloop.engine import LLMEngine
    from tokenloop.llm import LLM
    from tokenloop.outputs import CompletionOutput, RequestOutput
    from tokenloop.request import LoRARequest, SamplingParams

# Imported when first named: `import tokenloop.cli` must not import torch (~1.6 s), so that `tokenloop
# serve` can start its engine core process before this process imports the server's own modules.
_EXPORTS = {"LLM": "tokenloop.llm", "LLMEngine": "tokenloop.engine", "RequestOutput": "tokenloop.outputs",
            "CompletionOutput": "tokenloop.outputs", "SamplingParams": "tokenloop.request",
            "EngineConfig": "tokenloop.config", "CacheConfig": "tokenloop.config",
            "SchedulerConfig": "tokenloop.config", "LoRARequest": "tokenloop.request"}

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "CacheConfig", "SchedulerConfig", "RequestOutput",
           "CompletionOutput", "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenloop' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
