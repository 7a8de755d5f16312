"""What tracing costs: engine step times with tracing off vs on, interleaved in one run.

One engine on the default model runs N requests (random prompt ids, fixed output lengths) with a `Tracer`
among its observers, and flips `tracer.enabled` before every step, so "off" and "on" steps alternate over
the same batch, the same cache state and the same machine noise. Only full decode steps at the target batch
size are compared (the steady state a server spends its time in). Reported:

- median and mean step time with tracing off and on, and the difference as a fraction of the step;
- the time spent inside the tracer's record handlers on "on" steps (measured directly around each call),
  and the time the engine core spends building each step's `StepRecord` (paid whenever any observer is
  registered, the tracer off included); neither depends much on machine noise.

With --two-engines it also interleaves steps of an engine without observers (no record is built) and one
with tracing on, round-robin, on the same workload.

Usage: python scripts/bench_tracing.py [--batch 32] [--prompt-len 64] [--max-tokens 64] [--two-engines]
"""

from __future__ import annotations

import argparse
import functools
import platform
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tokenloop.engine import LLMEngine
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import DEFAULT_MODEL, load_checkpoint
from tokenloop.observe.tracer import Tracer
from tokenloop.request import SamplingParams

HOOKS = ("on_arrival", "on_step", "on_release")


def instrument(target: object, names: tuple[str, ...], spent: list[float]) -> None:
    """Wrap methods on this instance so that time spent inside them adds up in spent[0]."""
    for name in names:
        original: Callable[..., Any] = getattr(target, name)

        @functools.wraps(original)
        def timed(*args: Any, __original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - begin

        setattr(target, name, timed)


def is_decode_step(outputs: list[Any], batch: int, started: set[str]) -> bool:
    """Every request of the full batch got one token, and none of them its first (no prefill in the step).

    `started` holds the requests that already had a token; this step's are added to it.
    """
    decode = len(outputs) == batch and all(
        len(o.outputs[0].token_ids_delta) == 1 and o.request_id in started for o in outputs)
    started.update(o.request_id for o in outputs if o.outputs[0].token_ids_delta)
    return decode


def submit(engine: LLMEngine, batch: int, prompt_len: int, max_tokens: int, vocab: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(batch):
        prompt = [rng.randrange(100, vocab) for _ in range(prompt_len)]
        engine.add_request(f"b{seed}-{i}", None, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                 ignore_eos=True), prompt_token_ids=prompt)


def summarize(label: str, times: list[float]) -> dict[str, float]:
    ms = sorted(1e3 * t for t in times)
    trimmed = ms[len(ms) // 10: len(ms) - len(ms) // 10] or ms
    row = {"n": len(ms), "median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
           "trimmed_mean_ms": statistics.fmean(trimmed)}
    print(f"  {label:<22} n={row['n']:<4} median {row['median_ms']:8.2f} ms   mean {row['mean_ms']:8.2f} ms   "
          f"10%-trimmed mean {row['trimmed_mean_ms']:8.2f} ms")
    return row


def toggled(args: argparse.Namespace, checkpoint: Any) -> None:
    """One engine, tracing flipped on and off every step."""
    config = build_engine_config(args.model, max_num_seqs=args.batch, max_num_batched_tokens=max(512, args.batch),
                                 num_blocks=args.batch * (-(-(args.prompt_len + args.max_tokens) // 16) + 1) + 8)
    tracer = Tracer()
    engine = LLMEngine(config, checkpoint=checkpoint, tracer=tracer)
    spent = [0.0]
    instrument(tracer, HOOKS, spent)
    building = [0.0]
    instrument(engine.core, ("_record",), building)
    vocab = checkpoint.config.vocab_size
    off: list[float] = []
    on: list[float] = []
    hook_s: list[float] = []
    record_s: list[float] = []
    started: set[str] = set()
    for round_ in range(args.rounds):
        submit(engine, args.batch, args.prompt_len, args.max_tokens, vocab, seed=round_)
        flip = round_ % 2 == 0
        while engine.has_unfinished_requests():
            flip = not flip
            tracer.enabled = flip
            spent[0] = building[0] = 0.0
            begin = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - begin
            if is_decode_step(outputs, args.batch, started):
                (on if flip else off).append(elapsed)
                record_s.append(building[0])
                if flip:
                    hook_s.append(spent[0])
    print(f"\n[1] one engine, tracing toggled every step (batch {args.batch} decode steps only)")
    a = summarize("tracing off", off)
    b = summarize("tracing on", on)
    print(f"  difference: median {100 * (b['median_ms'] / a['median_ms'] - 1):+.2f} %, "
          f"trimmed mean {100 * (b['trimmed_mean_ms'] / a['trimmed_mean_ms'] - 1):+.2f} %")
    hooks_ms = [1e3 * s for s in hook_s]
    print(f"  inside the tracer's handlers per traced step: median {statistics.median(hooks_ms):.3f} ms, "
          f"max {max(hooks_ms):.3f} ms = {100 * statistics.median(hooks_ms) / a['median_ms']:.3f} % of the "
          "median untraced step")
    build_ms = [1e3 * s for s in record_s]
    print(f"  building the StepRecord per step (tracer on or off): "
          f"median {statistics.median(build_ms):.3f} ms, "
          f"max {max(build_ms):.3f} ms = {100 * statistics.median(build_ms) / a['median_ms']:.3f} % of the "
          "median untraced step")
    print(f"  recorded: {len(tracer.iterations)} iterations, {len(tracer.request_ids())} request traces")


def two_engines(args: argparse.Namespace, checkpoint: Any) -> None:
    """An engine without observers and one with tracing on, stepped round-robin on the same workload."""
    config = build_engine_config(args.model, max_num_seqs=args.batch, max_num_batched_tokens=max(512, args.batch),
                                 num_blocks=args.batch * (-(-(args.prompt_len + args.max_tokens) // 16) + 1) + 8)
    engines = {"no tracer": LLMEngine(config, checkpoint=checkpoint),
               "tracing on": LLMEngine(config, checkpoint=checkpoint, tracer=Tracer())}
    vocab = checkpoint.config.vocab_size
    times: dict[str, list[float]] = {name: [] for name in engines}
    started: dict[str, set[str]] = {name: set() for name in engines}
    for round_ in range(args.rounds):
        for engine in engines.values():
            submit(engine, args.batch, args.prompt_len, args.max_tokens, vocab, seed=round_)
        order = list(engines.items())
        while any(engine.has_unfinished_requests() for engine in engines.values()):
            order.reverse()  # ABBA: neither engine always runs first
            for name, engine in order:
                if not engine.has_unfinished_requests():
                    continue
                begin = time.perf_counter()
                outputs = engine.step()
                elapsed = time.perf_counter() - begin
                if is_decode_step(outputs, args.batch, started[name]):
                    times[name].append(elapsed)
    print(f"\n[2] two engines round-robin (batch {args.batch} decode steps only)")
    a = summarize("no tracer", times["no tracer"])
    b = summarize("tracing on", times["tracing on"])
    print(f"  difference: median {100 * (b['median_ms'] / a['median_ms'] - 1):+.2f} %, "
          f"trimmed mean {100 * (b['trimmed_mean_ms'] / a['trimmed_mean_ms'] - 1):+.2f} %")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="batches of requests, run one after another")
    parser.add_argument("--two-engines", action="store_true", help="also compare an engine without a tracer")
    args = parser.parse_args()
    print(f"tokenloop tracing overhead: {args.model}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}")
    checkpoint = load_checkpoint(args.model)
    toggled(args, checkpoint)
    if args.two_engines:
        two_engines(args, checkpoint)


if __name__ == "__main__":
    main()
