"""Prompts for `bench serve`: random token ids, shared prefixes, ShareGPT, or a trace file.

Every data set becomes a list of `TraceRequest`s, so the client has one input type. Random and prefix
prompts are token ids (sent as-is to /v1/completions, which accepts ids), so no tokenizer is needed;
the chat endpoint takes text, and ids are decoded with a local tokenizer for it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tokenloop.bench.sharegpt import sharegpt_conversations, sharegpt_prompts
from tokenloop.bench.trace import TraceConfig, TraceRequest, load_trace

if TYPE_CHECKING:
    from tokenloop.tokenizer import Tokenizer

# Twenty short raw-text prompts (no chat template) for greedy agreement checks between number formats and
# engines: the real-model agreement test and scripts/agreement_llama_cpp.py read the same list.
AGREEMENT_PROMPTS = (
    "The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
    "Explain why the sky is blue.", "List three fruits:", "Once upon a time, in a small village,",
    "The best way to learn a language is", "Translate to French: good morning", "What is 12 times 12?",
    "A recipe for bread needs", "import numpy as np\n", "The meaning of life is",
    "Summarise: The cat sat on the mat all day long.", "My favourite season is autumn because",
    "Name the planets of the solar system.", "How do trains work?", "Dear Sir or Madam,",
    "The quick brown fox", "Q: Who wrote Hamlet?\nA:", "Three tips for better sleep:",
)
DATASETS = ("random", "sharegpt", "prefix", "trace")


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of a local model (name, .gguf file or HF directory) without loading its weights."""
    from tokenloop.model.gguf_file import GGUFFile
    from tokenloop.model.loader import resolve_model_path
    from tokenloop.tokenizer import Tokenizer

    path = resolve_model_path(model)
    if path.is_dir():
        return Tokenizer.from_pretrained_dir(path)
    return Tokenizer.from_gguf(GGUFFile(path).metadata, source=str(path))


def parse_token_range(text: str) -> tuple[int, int]:
    """'10:380' -> (10, 380): token ids are drawn from [low, high)."""
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high))
    except ValueError:
        raise ValueError(f"token id range {text!r} must be LOW:HIGH, e.g. 10:380") from None
    if not sep or not 0 <= bounds[0] < bounds[1]:
        raise ValueError(f"token id range {text!r}: need 0 <= LOW < HIGH")
    return bounds


@dataclass(frozen=True)
class DatasetConfig:
    """Which prompts to send and how long they and their outputs are (in tokens)."""

    name: str = "random"
    num_prompts: int = 100
    seed: int = 0
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    token_id_range: tuple[int, int] = (10, 380)
    prefix_len: int = 256
    num_prefixes: int = 4
    sharegpt_output_len: int | None = None  # fixed output length instead of the reply's
    trace_path: str | None = None

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r} (valid: {', '.join(DATASETS)})")
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {self.random_range_ratio}")
        if self.random_input_len < 1 or self.random_output_len < 1:
            raise ValueError("random input and output lengths must be >= 1")
        if self.name == "trace" and not self.trace_path:
            raise ValueError("the trace dataset needs a trace file (--trace FILE)")


def _ranged_len(rng: random.Random, length: int, ratio: float) -> int:
    """A length drawn uniformly from [length * (1 - ratio), length * (1 + ratio)], at least 1."""
    low, high = math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))
    return max(1, rng.randint(low, high))


def build_requests(config: DatasetConfig, tokenizer: Tokenizer | None = None) -> list[TraceRequest]:
    """The benchmark's requests. Arrival times are set only for a trace (the client schedules the rest)."""
    rng = random.Random(config.seed)
    low, high = config.token_id_range
    n = config.num_prompts
    if config.name == "trace":
        requests = load_trace(Path(config.trace_path or ""))
        return requests[:n]
    if config.name == "sharegpt":
        trace_config = TraceConfig(num_requests=n, seed=config.seed, max_prompt_len=1024, max_output_len=2048)
        source = sharegpt_prompts(trace_config, sharegpt_conversations(), rng, tokenizer)
        out = []
        for i in range(n):
            tokens = source.tokens[i]
            max_tokens = config.sharegpt_output_len or source.output_lens[i]
            out.append(TraceRequest(id=f"sharegpt-{i}", arrival_s=0.0, max_tokens=max_tokens,
                                    prompt=source.texts[i], prompt_tokens=tuple(tokens) if tokens else None))
        return out
    prefixes = [[rng.randrange(low, high) for _ in range(config.prefix_len)] for _ in range(config.num_prefixes)]
    out = []
    for i in range(n):
        input_len = _ranged_len(rng, config.random_input_len, config.random_range_ratio)
        output_len = _ranged_len(rng, config.random_output_len, config.random_range_ratio)
        tokens = [rng.randrange(low, high) for _ in range(input_len)]
        prefix_id = None
        if config.name == "prefix":
            group = i % config.num_prefixes
            tokens = prefixes[group] + tokens
            prefix_id = f"prefix-{group}"
        out.append(TraceRequest(id=f"{config.name}-{i}", arrival_s=0.0, max_tokens=output_len,
                                prompt_tokens=tuple(tokens), prefix_id=prefix_id))
    return out


def as_text_prompts(requests: Sequence[TraceRequest], tokenizer: Tokenizer | None) -> list[TraceRequest]:
    """Token-id prompts decoded to text (the chat endpoint takes only text)."""
    if all(r.prompt_tokens is None for r in requests):
        return list(requests)
    if tokenizer is None:
        raise ValueError("the chat endpoint needs text prompts, and these are token ids: pass --tokenizer "
                         "(a local model name or path) to decode them, or use --endpoint /v1/completions")
    return [r if r.prompt_tokens is None else
            replace(r, prompt=tokenizer.decode(list(r.prompt_tokens), skip_special_tokens=False) or " ",
                    prompt_tokens=None)
            for r in requests]
