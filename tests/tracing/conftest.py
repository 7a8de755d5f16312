"""Engines on the tiny model with a tracer, and helpers to run them to the end."""

from __future__ import annotations

from typing import Any

from tests.conftest import TINY_PROMPTS
from tokenloop.engine import LLMEngine
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint
from tokenloop.observe.tracer import Tracer
from tokenloop.outputs import RequestOutput
from tokenloop.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = TINY_PROMPTS


def make_engine(tiny: Checkpoint, tracer: Tracer | None = None, **options: Any) -> LLMEngine:
    options.setdefault("max_num_seqs", 8)
    options.setdefault("max_num_batched_tokens", 64)
    options.setdefault("block_size", 4)
    options.setdefault("num_blocks", 128)
    return LLMEngine(build_engine_config(str(tiny.path), **options), checkpoint=tiny, tracer=tracer)


def run_to_end(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until idle; the last output of each request, by id."""
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            last[output.request_id] = output
    return last
