"""Where a chunked prefill (or a many-row decode step) goes: per kernel kind, ms and achieved GFLOP/s.

A 2k-token prompt runs as the scheduler chunks it (`--chunk`, max_num_batched_tokens: 512 by default), each
chunk attending over the ones before it, through `fused_cpu.forward_fused` with `profile_decode_step.py`'s
KernelTimer around each kernel (`time.thread_time`, one thread by default: the machine is shared, and CPU
seconds of this thread are what a busy neighbour disturbs least). `--decode-rows N` profiles one decode step
of N sequences instead (the LM head vs the layers). GEMMs report 2 M N K / seconds.
Usage: python scripts/profile_prefill.py --model FILE [--length 2048] [--chunk 512] [--threads 1]
  [--decode-rows 32 --context 128] [--repeats 2] [--gemm-min-rows 1000000 (the decode kernels only)]
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
from scripts.bench_forward import build_form
from scripts.profile_decode_step import KernelTimer
from tests.model.paged_harness import PagedHarness, Sequence
from tokenloop.model import int8_gemm
from tokenloop.model.loader import load_checkpoint
from tokenloop.model.models.llama import LlamaModel


def chunked_prefill(model: LlamaModel, length: int, chunk: int) -> Callable[[], None]:
    """A run of one `length`-token prompt in chunks of `chunk` tokens (logits of the last token only), through the
    test harness's paged KV, which knows models' KV groups (Gemma 3's sliding layers); each run prefills the same
    blocks again."""
    harness = PagedHarness(model, num_blocks=length // 16 + 2)
    generator = torch.Generator().manual_seed(1)
    sequence = Sequence(torch.randint(model.config.vocab_size, (length,), generator=generator).tolist())

    def run() -> None:
        sequence.num_computed = 0
        for start in range(0, length, chunk):
            harness.step([(sequence, min(chunk, length - start))])

    return run


def decode_step(model: LlamaModel, rows: int, context: int, steps: int) -> Callable[[], None]:
    """`rows` sequences with `context` tokens cached (untimed); a run is one decode step of them all (at most
    `steps` runs: each adds a token). Through the test harness's paged KV, which knows models' KV groups."""
    harness = PagedHarness(model, num_blocks=rows * ((context + steps) // 16 + 2))
    generator = torch.Generator().manual_seed(0)
    sequences = [Sequence(torch.randint(model.config.vocab_size, (context + steps,), generator=generator).tolist())
                 for _ in range(rows)]
    for sequence in sequences:
        harness.step([(sequence, context)])
    return lambda: harness.step([(sequence, 1) for sequence in sequences])


def flop_counter(flops: dict[str, float], timer: KernelTimer, head_weight: Any) -> Callable[[], None]:
    """Adds 2 M N K per projection and LM head call to `flops` under the timer's kind; returns the undo."""
    project, head = fused_module.project, timer.model.lm_head

    def form(weight: Any, rows: int) -> str:
        return weight.form_for(rows) if hasattr(weight, "form_for") else str(weight.dtype)

    def counted_project(x: torch.Tensor, weight: Any) -> torch.Tensor:
        out = project(x, weight)
        flops[f"gemm {timer.names.get(id(weight), '?')} ({form(weight, x.shape[0])})"] += \
            2.0 * x.shape[0] * x.shape[1] * out.shape[1]
        return out

    def counted_head(x: torch.Tensor) -> torch.Tensor:
        out = head(x)
        kind = f"lm head ({form(head_weight, x.shape[0])})" if hasattr(head_weight, "form_for") else "lm head"
        flops[kind] += 2.0 * x.shape[0] * x.shape[1] * out.shape[1]
        return out

    fused_module.project = counted_project
    timer.model.lm_head = counted_head

    def undo() -> None:
        fused_module.project, timer.model.lm_head = project, head
    return undo


def profile(model: LlamaModel, run: Callable[[], None], repeats: int, title: str, tokens: int) -> None:
    run()  # warm-up
    head_weight = model.lm_head.weight
    totals, kinds, flops = [], defaultdict(list), defaultdict(float)
    for _ in range(repeats):
        timer = KernelTimer(model)
        undo = timer.install()
        flops.clear()
        undo_flops = flop_counter(flops, timer, head_weight)
        try:
            start = time.thread_time()
            run()
            totals.append(time.thread_time() - start)
        finally:
            undo_flops()
            undo()
        for kind, seconds in timer.seconds.items():
            kinds[kind].append(seconds)
    total = statistics.median(totals)
    print(f"\n## {title}: {total * 1e3:.1f} ms ({tokens / total:.1f} tok/s), {torch.get_num_threads()} thread(s), "
          f"time.thread_time, median of {repeats}")
    print(f"  {'kind':<44}{'ms':>10}{'share':>8}{'GFLOP/s':>10}")
    medians = {kind: statistics.median(values) for kind, values in kinds.items()}
    for kind, seconds in sorted(medians.items(), key=lambda item: -item[1]):
        rate = f"{flops[kind] / seconds / 1e9:>10.1f}" if flops.get(kind) else ""
        print(f"  {kind:<44}{seconds * 1e3:>10.1f}{seconds / total * 100:>7.1f}%{rate}")
    rest = total - sum(medians.values())
    print(f"  {'rest (Python, metadata, timers)':<44}{rest * 1e3:>10.1f}{rest / total * 100:>7.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--form", default="auto", help="a bench_forward.py form")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--decode-rows", type=int, default=0)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gemm-min-rows", type=int, default=int8_gemm.GEMM_MIN_ROWS,
                        help="fewest rows a projection sends to the many-row GEMM (a large value: none, as before it)")
    args = parser.parse_args()
    int8_gemm.GEMM_MIN_ROWS = args.gemm_min_rows
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint(args.model, keep_quantized=True)
    model, described = build_form(checkpoint, args.form)
    print(f"{args.model} {args.form}: {described}")
    with torch.inference_mode():
        if args.decode_rows:
            run = decode_step(model, args.decode_rows, args.context, args.repeats + 1)
            profile(model, run, args.repeats, f"decode step, {args.decode_rows} rows, context {args.context}",
                    args.decode_rows)
        else:
            profile(model, chunked_prefill(model, args.length, args.chunk), args.repeats,
                    f"prefill of {args.length} tokens in chunks of {args.chunk}", args.length)


if __name__ == "__main__":
    main()
