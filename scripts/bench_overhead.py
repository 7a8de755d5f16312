"""Engine overhead per step (step wall time minus model forward time) against output length.

256 requests (short random prompts, `ignore_eos`, greedy) run on a tiny random Llama, so the forward is
small and what the engine does around it shows. Over the steady decode phase (every request running
and decoding one token) it reports the mean step time, forward time and their difference, and the same
over the last steps of the run, where outputs are longest: work that grows with output length shows as
an overhead that rises from the first table row to the last, and from the "mean" to the "last" column.

The forward time is `RunnerOutput.forward_s`, read by wrapping `engine.runner.execute`; when the engine
takes observers (`LLMEngine(..., observers=[obs])`, `obs.on_step(StepRecord)`), the record's
`forward_ns` / `start_ns` / `end_ns` are used instead.

Usage: python scripts/bench_overhead.py [--requests 256] [--lengths 128 512 2048] [--last 64]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import write_tiny_llama
from tokenloop.engine import LLMEngine
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import load_checkpoint
from tokenloop.request import SamplingParams

PROMPT_LEN = 16


@dataclass
class StepTimes:
    """One engine step: its wall time, the forward inside it, and whether it was a full decode step."""

    total_s: float
    forward_s: float
    full_decode: bool
    build_s: float = 0.0  # runner.execute outside the forward: step tensors and attention metadata
    sample_s: float = 0.0


@dataclass
class _Recorder:
    """Collects forward time and batch shape from the runner (or from StepRecords) during one step."""

    num_requests: int
    forward_s: float = 0.0
    execute_s: float = 0.0
    sample_s: float = 0.0
    full_decode: bool = False
    records: list[Any] = field(default_factory=list)

    def on_step(self, record: Any) -> None:  # the engine core's observer interface
        self.records.append(record)

    def on_release(self, info: Any) -> None:
        pass


def tiny_checkpoint(directory: Path, max_len: int):
    write_tiny_llama(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = max_len  # the tests' model stops at 1,024 positions
    config_path.write_text(json.dumps(config))
    return load_checkpoint(str(directory))


def run(checkpoint: Any, num_requests: int, output_len: int, seed: int) -> list[StepTimes]:
    max_len = PROMPT_LEN + output_len
    blocks_per_request = -(-max_len // 16)
    config = build_engine_config(str(checkpoint.path) if hasattr(checkpoint, "path") else "tiny",
                                 max_num_seqs=num_requests, max_num_batched_tokens=max(2048, num_requests),
                                 num_blocks=num_requests * blocks_per_request + 64, block_size=16,
                                 enable_prefix_caching=False, dtype="float32")
    recorder = _Recorder(num_requests)
    kwargs: dict[str, Any] = {}
    if "observers" in inspect.signature(LLMEngine.__init__).parameters:
        kwargs["observers"] = [recorder]
    engine = LLMEngine(config, checkpoint=checkpoint, **kwargs)

    execute = engine.runner.execute

    sample = engine.sampler.sample

    def timed_execute(schedule: Any) -> Any:
        begin = time.perf_counter()
        result = execute(schedule)
        recorder.execute_s += time.perf_counter() - begin
        recorder.forward_s += result.forward_s
        recorder.full_decode = (len(schedule.scheduled) == num_requests
                                and schedule.num_batched_tokens == num_requests)
        return result

    def timed_sample(logits: Any, batch: Any) -> Any:
        begin = time.perf_counter()
        result = sample(logits, batch)
        recorder.sample_s += time.perf_counter() - begin
        return result

    engine.runner.execute = timed_execute  # type: ignore[method-assign]
    engine.sampler.sample = timed_sample  # type: ignore[method-assign]
    rng = random.Random(seed)
    vocab = checkpoint.config.vocab_size
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    for i in range(num_requests):
        engine.add_request(f"r{i}", None, params,
                           prompt_token_ids=[rng.randrange(10, vocab) for _ in range(PROMPT_LEN)])
    steps: list[StepTimes] = []
    while engine.has_unfinished_requests():
        recorder.forward_s, recorder.execute_s, recorder.sample_s, recorder.full_decode = 0.0, 0.0, 0.0, False
        num_records = len(recorder.records)
        begin = time.perf_counter()
        engine.step()
        total = time.perf_counter() - begin
        forward = recorder.forward_s
        if len(recorder.records) > num_records:  # the engine's own record of the step, when it has one
            record = recorder.records[-1]
            total, forward = (record.end_ns - record.start_ns) / 1e9, record.forward_ns / 1e9
        steps.append(StepTimes(total, forward, recorder.full_decode, recorder.execute_s - recorder.forward_s,
                               recorder.sample_s))
    return steps


def summarise(steps: list[StepTimes], last: int) -> dict[str, float]:
    decode = [s for s in steps if s.full_decode]
    tail = decode[-last:]

    def stats(rows: list[StepTimes]) -> tuple[float, float, float]:
        total = sum(s.total_s for s in rows)
        overhead = sum(s.total_s - s.forward_s for s in rows)
        return 1e3 * total / len(rows), 1e3 * overhead / len(rows), 100 * overhead / total

    step_ms, over_ms, over_pct = stats(decode)
    _, tail_ms, tail_pct = stats(tail)
    median_over = 1e3 * statistics.median(s.total_s - s.forward_s for s in decode)
    build_ms = 1e3 * statistics.mean(s.build_s for s in decode)
    tail_build_ms = 1e3 * statistics.mean(s.build_s for s in tail)
    sample_ms = 1e3 * statistics.mean(s.sample_s for s in decode)
    tail_sample_ms = 1e3 * statistics.mean(s.sample_s for s in tail)
    return {"build_ms": build_ms, "tail_build_ms": tail_build_ms, "sample_ms": sample_ms,
            "tail_sample_ms": tail_sample_ms, "steps": len(decode), "step_ms": step_ms, "overhead_ms": over_ms,
            "overhead_pct": over_pct,
            "median_overhead_ms": median_over, "tail_overhead_ms": tail_ms, "tail_overhead_pct": tail_pct}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--last", type=int, default=64, help="steps at the end of the run for the tail column")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gc", choices=("default", "engine-process", "off"), default="default",
                        help="the collector as CPython sets it, as the engine core process sets it, or off")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = tiny_checkpoint(Path(tmp), PROMPT_LEN + max(args.lengths) + 16)
        if args.gc == "engine-process":
            from tokenloop.core.core_process import _GC_THRESHOLDS

            gc.collect()
            gc.freeze()
            gc.set_threshold(*_GC_THRESHOLDS)
        elif args.gc == "off":
            gc.disable()
        rows = []
        for length in args.lengths:
            begin = time.perf_counter()
            summary = summarise(run(checkpoint, args.requests, length, args.seed), args.last)
            summary["wall_s"] = time.perf_counter() - begin
            rows.append((length, summary))
            print(f"# output {length}: {summary}", file=sys.stderr, flush=True)
    print(f"\n{args.requests} running requests, tiny random Llama (2 layers, width 64), fp32, greedy, "
          f"{torch.get_num_threads()} threads, gc {args.gc}")
    print("| output tokens | decode steps | step ms | forward ms | overhead ms | overhead % "
          f"| overhead ms, last {args.last} steps | overhead %, last {args.last} "
          f"| of it: batch build ms (mean / last {args.last}) | sampler ms (mean / last {args.last}) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for length, s in rows:
        print(f"| {length:,} | {s['steps']:.0f} | {s['step_ms']:.2f} | {s['step_ms'] - s['overhead_ms']:.2f} "
              f"| {s['overhead_ms']:.2f} | {s['overhead_pct']:.1f}% | {s['tail_overhead_ms']:.2f} "
              f"| {s['tail_overhead_pct']:.1f}% | {s['build_ms']:.2f} / {s['tail_build_ms']:.2f} "
              f"| {s['sample_ms']:.2f} / {s['tail_sample_ms']:.2f} |")


if __name__ == "__main__":
    main()
