"""Python bytecodes a steady decode step of the engine core executes, per function: a count that does not
depend on the machine's load, to compare commits where timings are too noisy (`bench_overhead.py` measures
the time).

The workload is `bench_overhead.py`'s (tiny random Llama, 16-token random prompts, greedy, `ignore_eos`) with
the model's forward replaced by fixed logits, so only the engine's own work runs. Counted: every `core.step()`
in which all requests are running and decode one token and none finishes. Torch and numpy calls count as one
bytecode each here; their cost is what `bench_overhead.py` (or callgrind) shows.

Usage: python scripts/count_step_bytecodes.py [--requests 128] [--length 40] [--steps 10] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_overhead import PROMPT_LEN, tiny_checkpoint
from tokenloop.engine import LLMEngine
from tokenloop.llm import build_engine_config
from tokenloop.request import SamplingParams

ROOT = str(Path(__file__).resolve().parents[1]) + "/"


def count_steps(num_requests: int, length: int, num_steps: int) -> tuple[int, collections.Counter[str]]:
    """(steps counted, bytecodes per `file:function` over them)."""
    counts: collections.Counter[str] = collections.Counter()

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        key = f"{frame.f_code.co_filename.removeprefix(ROOT)}:{frame.f_code.co_name}"

        def per_opcode(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "opcode":
                counts[key] += 1
            return per_opcode
        return per_opcode

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = tiny_checkpoint(Path(tmp), PROMPT_LEN + length + 16)
        logits = torch.randn(num_requests + 8, checkpoint.config.vocab_size)
        config = build_engine_config(str(checkpoint.path), max_num_seqs=num_requests,
                                     max_num_batched_tokens=max(2048, num_requests),
                                     num_blocks=num_requests * (-(-(PROMPT_LEN + length) // 16)) + 64,
                                     block_size=16, enable_prefix_caching=False, dtype="float32")
        engine = LLMEngine(config, checkpoint=checkpoint)
        engine.runner.model.forward = lambda ids, positions, meta, kv, logits_index, *rest: (  # type: ignore
            logits[:logits_index.shape[0]])
        rng = random.Random(0)
        params = SamplingParams(max_tokens=length, ignore_eos=True, temperature=0.0)
        for i in range(num_requests):
            engine.add_request(f"r{i}", None, params, prompt_token_ids=[
                rng.randrange(10, checkpoint.config.vocab_size) for _ in range(PROMPT_LEN)])
        core, done = engine.core, 0
        while engine.has_unfinished_requests():
            running = core.scheduler.running_requests()
            steady = (done < num_steps and len(running) == num_requests and core.scheduler.num_waiting == 0
                      and all(r.num_computed_tokens == r.num_tokens - 1 for r in running)
                      and max(r.num_output_tokens for r in running) < length - 1)
            if steady:
                sys.settrace(trace)
            outputs = core.step()
            if steady:
                sys.settrace(None)
                done += 1
            engine.outputs.process(outputs)
    return done, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--length", type=int, default=40)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    steps, counts = count_steps(args.requests, args.length, args.steps)
    print(f"{args.requests} requests, {steps} steady decode steps: "
          f"{sum(counts.values()) / steps:,.0f} bytecodes a step")
    for key, count in counts.most_common(args.top):
        print(f"{count / steps:10.1f}  {key}")


if __name__ == "__main__":
    main()
