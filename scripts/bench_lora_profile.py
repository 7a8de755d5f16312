"""Where 8 streams x 8 adapters lose their time against 8 base streams (issue 32): a profile, one run.

    PYTHONPATH=. python -u scripts/bench_lora_profile.py [--streams 8] [--tokens 32] [--rounds 3]
        [--lora-dtype auto|int8] [--products-only] [--slot-dtypes bfloat16 int8 ...]

1. Steps: base and adapter rounds alternated on one engine (as scripts/bench_lora.py runs them); each step's
   wall time, the forward's, and the Python time spent building the step's adapter arguments
   (`ModelRunner._lora_batch` + `LoRABatch.decode_arguments`), split into prefill steps and decode steps.
2. The products alone (`lora_sgmv`, one decode step's rows over `--streams` adapters, the step's dtypes): time
   per projection kind over the 30 layers, the bytes of A and B each reads, and the rate it reaches, on one
   thread and on all.
Measurement wraps the runner from outside (this script only); the engine is unchanged.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from scripts.bench_lora import throughput, write_adapter
from tokenloop import LLM
from tokenloop.model.loader import DEFAULT_MODEL, load_checkpoint
from tokenloop.model.lora import FUSED_PROJECTIONS
from tokenloop.model.lora_slots import AdapterSlots, LoRABatch


def _timed(record: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - begin)
    return wrapper


def profile_steps(llm: LLM, names: list[str], tokens: int, rounds: int) -> None:
    """Per step kind (prefill / decode) and run (base / adapters): step, execute, forward and adapter-argument
    milliseconds, medians over the rounds' steps, and each run's tok/s."""
    core = llm.engine.core
    runner = core.runner
    steps: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    build: list[float] = []
    runner._lora_batch = _timed(build, runner._lora_batch)
    decode_arguments = LoRABatch.decode_arguments
    LoRABatch.decode_arguments = _timed(build, decode_arguments)  # type: ignore[method-assign]
    execute = runner.execute
    run = ["base"]

    def traced_execute(output: Any) -> Any:
        build.clear()
        begin = time.perf_counter()
        result = execute(output)
        wall = time.perf_counter() - begin
        scheduled = output.scheduled
        tokens_in_step = sum(item.chunk.num_tokens for item in scheduled)
        kind = "decode" if tokens_in_step == len(scheduled) else "prefill"
        entry = steps[(run[0], kind)]
        entry["execute"].append(wall * 1e3)
        entry["forward"].append(result.forward_s * 1e3)
        entry["arguments"].append(sum(build) * 1e3)
        entry["tokens"].append(tokens_in_step)
        return result

    runner.execute = traced_execute
    core_step = core.step

    def traced_step() -> Any:
        begin = time.perf_counter()
        out = core_step()
        steps[(run[0], "all")]["step"].append((time.perf_counter() - begin) * 1e3)
        return out

    core.step = traced_step
    rates: dict[str, list[float]] = defaultdict(list)
    for _ in range(rounds):
        for label, adapters in (("base", [None] * len(names)), ("adapters", list(names))):
            run[0] = label
            rates[label].append(throughput(llm, adapters, tokens)[0])
    for label in ("base", "adapters"):
        print(f"{label}: tok/s {', '.join(f'{r:.1f}' for r in rates[label])}; step ms (all) median "
              f"{statistics.median(steps[(label, 'all')]['step']):.2f}, total "
              f"{sum(steps[(label, 'all')]['step']) / rounds:.1f} per round")
        for kind in ("prefill", "decode"):
            entry = steps[(label, kind)]
            if not entry["execute"]:
                continue
            print(f"  {kind}: {len(entry['execute']) // rounds} steps a round ({statistics.median(entry['tokens']):.0f}"
                  f" tokens), execute {statistics.median(entry['execute']):.2f} ms, forward "
                  f"{statistics.median(entry['forward']):.2f} ms, adapter arguments "
                  f"{statistics.median(entry['arguments']) * 1e3:.0f} us (medians); execute total "
                  f"{sum(entry['execute']) / rounds:.1f} ms a round")
    runner.execute, core.step = execute, core_step
    del runner._lora_batch
    LoRABatch.decode_arguments = decode_arguments  # type: ignore[method-assign]


def profile_products(slots: AdapterSlots, rows: int, x_dtype: torch.dtype, out_dtype: torch.dtype,
                     repeat: int) -> None:
    """`lora_sgmv` alone for one decode step of `rows` rows over `slots.max_loras` adapters (row i on slot
    i % max_loras), the four projections of each layer in turn as a step runs them (so that the 78 MB of a
    step stream from memory, not from the caches): ms per projection kind over all layers, the bytes of A and
    B each reads, GB/s; on one thread and on all."""
    kernel = slots.kernel
    assert kernel is not None, "the C++ kernels are not built here"
    token_slots = torch.tensor([row % slots.max_loras for row in range(rows)], dtype=torch.long)
    used = min(rows, slots.max_loras)
    size = slots.a[0]["qkv"].element_size()
    layers = len(slots.a)
    scales = slots.scales if slots.quantized else [dict.fromkeys(FUSED_PROJECTIONS, torch.empty(0))] * layers
    xs = {kind: torch.randn(rows, slots.a[0][kind].shape[1]).to(x_dtype) for kind in FUSED_PROJECTIONS}
    outs = {kind: torch.zeros(rows, slots.bt[0][kind].shape[1], dtype=out_dtype) for kind in FUSED_PROJECTIONS}
    # Per used slot: A's width rows, and of B^T each part's rank rows over that part's columns only.
    bytes_of = {kind: layers * used * (slots.width[kind] * xs[kind].shape[1] + slots.max_rank
                                       * outs[kind].shape[1]) * size for kind in FUSED_PROJECTIONS}
    for threads in sorted({1, torch.get_num_threads()}):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        per_kind: dict[str, list[float]] = defaultdict(list)
        steps, cpu = [], []
        for _ in range(repeat + 1):
            spent = dict.fromkeys(FUSED_PROJECTIONS, 0.0)
            begin, begin_cpu = time.perf_counter(), time.process_time()
            for layer in range(layers):
                for kind in FUSED_PROJECTIONS:
                    call = time.perf_counter()
                    kernel.lora_sgmv(outs[kind], xs[kind], slots.a[layer][kind], slots.bt[layer][kind],
                                     scales[layer][kind], token_slots, slots.width[kind], slots.part_columns[kind])
                    spent[kind] += time.perf_counter() - call
            steps.append((time.perf_counter() - begin) * 1e3)
            cpu.append((time.process_time() - begin_cpu) * 1e3)
            for kind, seconds in spent.items():
                per_kind[kind].append(seconds * 1e3)
        steps, cpu = steps[1:], cpu[1:]  # the first warms up
        for kind in FUSED_PROJECTIONS:
            ms = statistics.median(per_kind[kind][1:])
            print(f"  {threads} thread(s) {kind:8s}: {ms:6.2f} ms a step ({layers} layers), "
                  f"{bytes_of[kind] / 1e6:5.1f} MB, {bytes_of[kind] / ms / 1e6:5.1f} GB/s")
        total = sum(bytes_of.values())
        print(f"  {threads} thread(s) step: wall median {statistics.median(steps):.2f} ms (min {min(steps):.2f}), "
              f"CPU {statistics.median(cpu):.2f} ms, {total / 1e6:.1f} MB, "
              f"{total / statistics.median(steps) / 1e6:.1f} GB/s (at the min {total / min(steps) / 1e6:.1f})")
        torch.set_num_threads(previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--products-only", action="store_true", help="skip the engine's steps (part 1)")
    parser.add_argument("--lora-dtype", default="auto", choices=["auto", "int8", "dense"], help="the engine's slots")
    parser.add_argument("--slot-dtypes", nargs="*", default=[], choices=["float32", "bfloat16", "int8"],
                        help="also time the products alone with the adapters in slots of these dtypes")
    args = parser.parse_args()
    config = load_checkpoint(DEFAULT_MODEL).config
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"ad{i}" for i in range(args.streams)]
        dirs = {name: write_adapter(Path(tmp) / name, config, args.rank, i) for i, name in enumerate(names)}
        options = {} if args.lora_dtype == "auto" else {"lora_dtype": args.lora_dtype}  # trees before the option
        llm = LLM(DEFAULT_MODEL, lora_modules={n: str(d) for n, d in dirs.items()}, max_loras=args.streams,
                  max_lora_rank=args.rank, **options)
        if not args.products_only:
            throughput(llm, [None, names[0]], 4)  # warm both paths
            profile_steps(llm, names, args.tokens, args.rounds)
        slots = llm.engine.core.adapters.slots
        slots.slots_for(names)
        x_dtype = out_dtype = torch.float32
        print(f"lora_sgmv alone, {args.streams} rows over {args.streams} adapters (A, B in {slots.dtype}; x, out "
              f"in {x_dtype}):")
        profile_products(slots, args.streams, x_dtype, out_dtype, args.repeat)
        for name in args.slot_dtypes:
            other = AdapterSlots(config, args.streams, args.rank, getattr(torch, name))
            for adapter in slots.registered.values():
                other.register(adapter)
            other.slots_for(names)
            print(f"lora_sgmv alone, slots in {other.dtype}:")
            profile_products(other, args.streams, x_dtype, out_dtype, args.repeat)
        del llm


if __name__ == "__main__":
    main()
