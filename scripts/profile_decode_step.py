"""Where a decode step of the default model goes: per kernel kind, in milliseconds per step.

A pure decode step runs every layer in one C++ call (`csrc/decode_layers.cpp`), which no profiler sees into.
Its Python twin (`fused_cpu.forward_fused` with `fused_decode` off) calls the same kernels in the same order,
so this script runs that twin with a timer around each call (`time.thread_time`, one thread by default: the
machine is shared) and reports each kind's share, next to the C++ loop's whole step (timed the same way), so
the difference is the Python loop's own cost. Steps are built as `bench_forward.py` builds them. Each
projection's line also gives the bytes its weights hold and the rate they were read at (`--clock wall` for the
rate a user sees with several threads: the main thread's thread time counts only its own share), and "best":
each call's fastest run summed (on a shared machine, the time a call takes when nothing else runs beside it).
Usage: python scripts/profile_decode_step.py [--batches 1,32] [--contexts 128,300] [--threads 1] [--steps 8]
       [--clock thread|wall]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tokenloop.model.fused_cpu as fused_module
from scripts.bench_forward import build_form, make_decode_run
from tokenloop.model.loader import load_checkpoint
from tokenloop.model.models.llama import LlamaModel
from tokenloop.model.quantized import PackedLinear


class KernelTimer:
    """Accumulates thread CPU time per kernel kind while installed on a model's Python layer loop."""

    def __init__(self, model: LlamaModel, clock: Callable[[], float] = time.thread_time) -> None:
        self.model = model
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, int] = defaultdict(int)  # weight bytes read per kind
        self.calls: list[tuple[str, float]] = []  # every timed call in order: the same order each run
        self.names = {}
        for layer in model.layers:
            for name in ("qkv", "o_proj", "gate_up", "down"):
                self.names[id(getattr(layer, name))] = name

    def timed(self, kind: str | Callable[..., str], fn: Callable[..., Any],
              weight_bytes: Callable[..., int] = lambda *args: 0) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = self.clock()
            result = fn(*args, **kwargs)
            name = kind if isinstance(kind, str) else kind(*args)
            spent = self.clock() - start
            self.seconds[name] += spent
            self.calls.append((name, spent))
            self.bytes[name] += weight_bytes(*args)
            return result
        return wrapper

    def install(self) -> Callable[[], None]:
        """Wrap the kernels `forward_fused` calls; returns the undo."""
        model, saved_project, saved_attention = self.model, fused_module.project, fused_module.paged_attention
        ops, head, embed = model.fused_ops, model.lm_head, model.embed

        def gemm_kind(x: torch.Tensor, weight: Any) -> str:
            form = weight.form_for(x.shape[0]) if hasattr(weight, "form_for") else str(weight.dtype)
            return f"gemm {self.names.get(id(weight), '?')} ({form})"

        class Ops:  # the fused elementwise kernels, each timed under its own name
            def __getattr__(inner, name: str) -> Any:
                return self.timed(name, getattr(ops, name))

        fused_module.project = self.timed(gemm_kind, saved_project, lambda x, weight: read_bytes(weight, x.shape[0]))
        fused_module.paged_attention = self.timed("paged_decode_attention", saved_attention)
        model.fused_ops = Ops()
        model.lm_head = self.timed(lambda x: f"lm head ({head.weight.form_for(x.shape[0])})"
                                   if hasattr(head.weight, "form_for") else "lm head", head,
                                   lambda x: read_bytes(head.weight, x.shape[0]))

        class Embed:
            def index_select(inner, dim: int, ids: torch.Tensor) -> torch.Tensor:
                return self.timed("embedding", embed.index_select)(dim, ids)

        model.embed = Embed()
        model.fused_decode = False

        def undo() -> None:
            fused_module.project, fused_module.paged_attention = saved_project, saved_attention
            model.fused_ops, model.lm_head, model.embed, model.fused_decode = ops, head, embed, True
        return undo


def read_bytes(weight: Any, rows: int) -> int:
    """The bytes of the form `weight` runs for `rows` rows (a pack, or its dense copy)."""
    if isinstance(weight, PackedLinear):
        if weight.dense is not None and rows > weight.packed_max_rows:
            return weight.dense.numel() * weight.dense.element_size()
        return weight.packed.nbytes
    return weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else 0


def seconds(fn: Callable[[], None], clock: Callable[[], float]) -> float:
    start = clock()
    fn()
    return clock() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--form", default="auto", help="a bench_forward.py form")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--contexts", default="128,300")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs; medians are reported")
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread")
    args = parser.parse_args()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint(args.model, keep_quantized=True)
    model, described = build_form(checkpoint, args.form)
    print(f"{args.form}: {described}; {torch.get_num_threads()} thread(s), {clock.__name__}, ms per step, "
          f"median of {args.repeats} runs of {args.steps} steps; load average {os.getloadavg()[0]:.1f}")
    with torch.inference_mode():
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                profile_case(model, batch, context, args.steps, args.repeats, clock)


def profile_case(model: LlamaModel, batch: int, context: int, steps: int, repeats: int,
                 clock: Callable[[], float]) -> None:
    run = make_decode_run(model, batch, context, steps)  # fills the cache: steps run past `context`
    run()  # warm-up
    cpp_steps, python_steps, kinds = [], [], defaultdict(list)
    kind_bytes: dict[str, float] = {}
    fastest: list[tuple[str, float]] = []  # per call, its fastest run
    for _ in range(repeats):  # C++ loop and timed Python loop interleaved: the same load on both
        cpp_steps.append(seconds(run, clock) / steps)
        timer = KernelTimer(model, clock)
        undo = timer.install()
        try:
            python_steps.append(seconds(run, clock) / steps)
        finally:
            undo()
        for kind, spent in timer.seconds.items():
            kinds[kind].append(spent / steps)
            kind_bytes[kind] = timer.bytes[kind] / steps
        fastest = timer.calls if not fastest else [(kind, min(spent, timer.calls[i][1]))
                                                   for i, (kind, spent) in enumerate(fastest)]
    best: dict[str, float] = defaultdict(float)
    for kind, spent in fastest:
        best[kind] += spent / steps
    cpp, python = statistics.median(cpp_steps), statistics.median(python_steps)
    print(f"\n## decode batch {batch}, context {context}: C++ loop step {cpp * 1e3:.2f} ms "
          f"(min {min(cpp_steps) * 1e3:.2f}), timed Python loop step {python * 1e3:.2f} ms")
    medians = {kind: statistics.median(values) for kind, values in kinds.items()}
    print(f"  {'kind':<34}{'median ms':>10} {'share':>6}  {'best ms':>8} {'share':>6}  weights, GB/s (median, best)")
    for kind, spent in sorted(medians.items(), key=lambda item: -item[1]):
        moved = kind_bytes[kind]
        rate = f"  {moved / 1e6:7.1f} MB {moved / spent / 1e9:5.1f} {moved / best[kind] / 1e9:5.1f}" if moved else ""
        print(f"  {kind:<34}{spent * 1e3:>10.3f} {spent / python * 100:>5.1f}%  {best[kind] * 1e3:>8.3f} "
              f"{best[kind] / sum(best.values()) * 100:>5.1f}%{rate}")
    print(f"  weights read: {sum(kind_bytes.values()) / 1e6:.1f} MB a step; the timed calls' best runs sum to "
          f"{sum(best.values()) * 1e3:.2f} ms")
    rest = python - sum(medians.values())
    print(f"  {'rest (Python, metadata, timers)':<34}{rest * 1e3:>9.3f} ms  {rest / python * 100:>5.1f}%")


if __name__ == "__main__":
    main()
