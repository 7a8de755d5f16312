"""A decode step of a Q4_K file with its Q4_K matrices held two ways, side by side in one process.

`auto` packs Q4_K as a K-quant (`KQuantDotWeight`: the file's codes, 8-bit sc / mn per 32 values and fp16 d /
dmin per 256, 4.63 bits a weight); `q4-pack` builds the same model with Q4_K in the Q4 int8-dot pack as before
(`Int4DotWeight`: fp16 d x sc and dmin x mn per 32 values, 5 bits a weight), by leaving Q4_K out of the K-quant
types while it builds. Runs of `--steps` pure decode steps (the one-call C++ loop, logits included, built as
`bench_forward.py` builds them) alternate between the two, so both see the same machine load. Wall and process
CPU time a step: median and fastest run.
Usage: python scripts/bench_q4k_pack.py --model FILE [--batches 1,8,32] [--steps 4] [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tokenloop.model.quantized as quantized
from scripts.bench_forward import build_form, make_decode_run
from tokenloop.model.loader import load_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    checkpoint = load_checkpoint(args.model, keep_quantized=True)
    models = {"auto": build_form(checkpoint, "auto")[0]}
    kquants = quantized.KQUANT_DOT_TYPES
    quantized.KQUANT_DOT_TYPES = tuple(t for t in kquants if t != GGMLQuantizationType.Q4_K)
    try:
        models["q4-pack"] = build_form(checkpoint, "auto")[0]
    finally:
        quantized.KQUANT_DOT_TYPES = kquants
    for name, model in models.items():
        forms = sorted({w.form for layer in model.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
                        if hasattr(w, "form")})
        print(f"{name}: {', '.join(forms)}")
    print(f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.1f}")
    with torch.inference_mode():
        for batch in map(int, args.batches.split(",")):
            runs = {name: make_decode_run(model, batch, args.context, args.steps) for name, model in models.items()}
            for run in runs.values():
                run()  # warm-up
            times: dict[tuple[str, str], list[float]] = {}
            for _ in range(args.repeats):
                for name, run in runs.items():
                    wall, cpu = time.perf_counter(), time.process_time()
                    run()
                    times.setdefault((name, "wall"), []).append((time.perf_counter() - wall) / args.steps)
                    times.setdefault((name, "cpu"), []).append((time.process_time() - cpu) / args.steps)
            print(f"batch {batch}: ms a step, median (fastest); load average {os.getloadavg()[0]:.1f}")
            for clock in ("wall", "cpu"):
                cells = "  ".join(f"{name} {statistics.median(times[name, clock]) * 1e3:7.1f} "
                                  f"({min(times[name, clock]) * 1e3:6.1f})" for name in runs)
                print(f"  {clock:<4}  {cells}")


if __name__ == "__main__":
    main()
