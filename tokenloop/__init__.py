"""tokenloop: a small LLM serving engine.

    from tokenloop import LLM, SamplingParams
    llm = LLM()  # the default model, SmolLM2-135M-Instruct
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
"""

from tokenloop.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenloop.engine import CompletionOutput, LLMEngine, RequestOutput
from tokenloop.llm import LLM
from tokenloop.request import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "CacheConfig", "SchedulerConfig",
           "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
