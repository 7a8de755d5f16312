"""The bare decode step with and without the one-call C++ layer loop (`csrc/decode_layers.cpp`), side by side.

One process, one model: runs of `--steps` pure decode steps alternate between the C++ loop (`fused_decode` on)
and the Python layer loop over the same kernels (off), so both see the same machine load; a tree whose loop
cannot run the model's weight forms (no plan) says so, and its two arms are then the same Python loop. Steps
are built as `bench_forward.py` builds them (a cached context, then decode steps past it), logits included.
Each step is timed by the wall clock and by the process's CPU time (all its threads: on a shared machine the
CPU time is the steadier measure of the work, the wall clock says what a user waits).
Usage: python scripts/bench_decode_loop.py --model FILE [--batches 1,8] [--context 128] [--steps 4] [--repeats 5]
An A/B against another checkout: run it with PYTHONPATH=<that tree>.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tokenloop
from scripts.bench_forward import build_form, make_decode_run
from tokenloop.model.loader import load_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--form", default="auto", help="a bench_forward.py form")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4, help="decode steps per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each loop; medians are reported")
    args = parser.parse_args()
    started = time.perf_counter()
    checkpoint = load_checkpoint(args.model, keep_quantized=True)
    model, described = build_form(checkpoint, args.form)
    print(f"tree {Path(tokenloop.__file__).parents[1]}; {described}; {torch.get_num_threads()} threads; "
          f"ready in {time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.1f}")
    with torch.inference_mode():
        for batch in map(int, args.batches.split(",")):
            run = make_decode_run(model, batch, args.context, args.steps)
            planned = model.fused_decode and model.decode_plan(batch) is not None
            run()  # warm-up (and the plan, which is cached per row count)
            times: dict[tuple[bool, str], list[float]] = {}
            for _ in range(args.repeats):
                for in_cpp in (True, False):
                    model.fused_decode = in_cpp
                    wall, cpu = time.perf_counter(), time.process_time()
                    run()
                    times.setdefault((in_cpp, "wall"), []).append((time.perf_counter() - wall) / args.steps)
                    times.setdefault((in_cpp, "cpu"), []).append((time.process_time() - cpu) / args.steps)
            model.fused_decode = True
            print(f"batch {batch}: C++ loop {'runs' if planned else 'has no plan (Python loop)'}; "
                  f"load average {os.getloadavg()[0]:.1f}; ms a step, median (min-max):")
            for clock in ("wall", "cpu"):
                cpp, python = (statistics.median(times[arm, clock]) * 1e3 for arm in (True, False))
                spread = {arm: f"{min(times[arm, clock]) * 1e3:.1f}-{max(times[arm, clock]) * 1e3:.1f}"
                          for arm in (True, False)}
                print(f"  {clock:<4}  C++ loop {cpp:7.1f} ({spread[True]})  Python loop {python:7.1f} "
                      f"({spread[False]})  Python / C++ {python / cpp:.2f}x")


if __name__ == "__main__":
    main()
