"""Where a decode step of the default model goes: per kernel kind, in milliseconds per step.

A pure decode step runs every layer in one C++ call (`csrc/decode_layers.cpp`), which no profiler sees into.
Its Python twin (`fused_cpu.forward_fused` with `fused_decode` off) calls the same kernels in the same order,
so this script runs that twin with a timer around each call (`time.thread_time`, one thread by default: the
machine is shared) and reports each kind's share, next to the C++ loop's whole step (timed the same way), so
the difference is the Python loop's own cost. Steps are built as `bench_forward.py` builds them.
Usage: python scripts/profile_decode_step.py [--batches 1,32] [--contexts 128,300] [--threads 1] [--steps 8]
"""

from __future__ import annotations

import argparse
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


class KernelTimer:
    """Accumulates thread CPU time per kernel kind while installed on a model's Python layer loop."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.seconds: dict[str, float] = defaultdict(float)
        self.names = {}
        for layer in model.layers:
            for name in ("qkv", "o_proj", "gate_up", "down"):
                self.names[id(getattr(layer, name))] = name

    def timed(self, kind: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            result = fn(*args, **kwargs)
            name = kind if isinstance(kind, str) else kind(*args)
            self.seconds[name] += time.thread_time() - start
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

        fused_module.project = self.timed(gemm_kind, saved_project)
        fused_module.paged_attention = self.timed("paged_decode_attention", saved_attention)
        model.fused_ops = Ops()
        model.lm_head = self.timed(lambda x: f"lm head ({head.weight.form_for(x.shape[0])})"
                                   if hasattr(head.weight, "form_for") else "lm head", head)

        class Embed:
            def index_select(inner, dim: int, ids: torch.Tensor) -> torch.Tensor:
                return self.timed("embedding", embed.index_select)(dim, ids)

        model.embed = Embed()
        model.fused_decode = False

        def undo() -> None:
            fused_module.project, fused_module.paged_attention = saved_project, saved_attention
            model.fused_ops, model.lm_head, model.embed, model.fused_decode = ops, head, embed, True
        return undo


def thread_seconds(fn: Callable[[], None]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--form", default="auto", help="a bench_forward.py form")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--contexts", default="128,300")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs; medians are reported")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint(args.model, keep_quantized=True)
    model, described = build_form(checkpoint, args.form)
    print(f"{args.form}: {described}; {torch.get_num_threads()} thread(s), time.thread_time, ms per step, "
          f"median of {args.repeats} runs of {args.steps} steps")
    with torch.inference_mode():
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                profile_case(model, batch, context, args.steps, args.repeats)


def profile_case(model: LlamaModel, batch: int, context: int, steps: int, repeats: int) -> None:
    run = make_decode_run(model, batch, context, steps)  # fills the cache: steps run past `context`
    run()  # warm-up
    cpp_steps, python_steps, kinds = [], [], defaultdict(list)
    for _ in range(repeats):  # C++ loop and timed Python loop interleaved: the same load on both
        cpp_steps.append(thread_seconds(run) / steps)
        timer = KernelTimer(model)
        undo = timer.install()
        try:
            python_steps.append(thread_seconds(run) / steps)
        finally:
            undo()
        for kind, seconds in timer.seconds.items():
            kinds[kind].append(seconds / steps)
    cpp, python = statistics.median(cpp_steps), statistics.median(python_steps)
    print(f"\n## decode batch {batch}, context {context}: C++ loop step {cpp * 1e3:.2f} ms "
          f"(min {min(cpp_steps) * 1e3:.2f}), timed Python loop step {python * 1e3:.2f} ms")
    medians = {kind: statistics.median(values) for kind, values in kinds.items()}
    for kind, seconds in sorted(medians.items(), key=lambda item: -item[1]):
        print(f"  {kind:<34}{seconds * 1e3:>9.3f} ms  {seconds / python * 100:>5.1f}%")
    rest = python - sum(medians.values())
    print(f"  {'rest (Python, metadata, timers)':<34}{rest * 1e3:>9.3f} ms  {rest / python * 100:>5.1f}%")


if __name__ == "__main__":
    main()
