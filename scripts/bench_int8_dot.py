"""The default model's GEMMs in each form they can run in, at the row counts of decode steps.

Layers: the four projections of all 30 layers (qkv 576->960, o_proj 576->576, gate_up 576->3072, down
1536->576), each layer with its own random weights so that they stream from memory as in a real step, in
- `int4_torch`: torch's int4 kernel (`aten._weight_int4pack_mm_for_cpu`, bf16 in and out; casts included),
- `int4_vnni`: our int8-dot kernel on the same codes (fp32 in and out, activations quantized inside),
- `bf16`: the dense bf16 copy, oneDNN-prepacked (the form above 16 rows today).
Head: the tied [49152, 576] Q8_0 matrix in `q8_0` (our fp32 kernel) and `q8_0_vnni` (the int8-dot kernel).
Forms are interleaved within each round (the machine is shared); ms per pass, median of the rounds, timed by
`time.thread_time` with one thread and by `time.perf_counter` (wall) with more.
Usage: python scripts/bench_int8_dot.py [--rows 1,4,8,16,32] [--threads 1] [--rounds 5] [--only layers|head]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenloop.model.int8_dot import Int4DotWeight, Q8DotWeight, int8_dot_available
from tokenloop.model.quantized import Int4Weight, Q8Weight, dense_linear, prepack_dense

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def random_q4(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3).half().float()
    m = (-8 * d + torch.randn(n, k // 32, generator=gen) * 1e-3).half().float()
    return codes, d, m


def layer_forms(gen: torch.Generator) -> dict[str, dict[str, list]]:
    """Per form, per projection: LAYERS weights."""
    forms: dict[str, dict[str, list]] = {"int4_torch": {}, "int4_vnni": {}, "bf16": {}}
    for name, (n, k) in SHAPES.items():
        for form in forms.values():
            form[name] = []
        for _ in range(LAYERS):
            codes, d, m = random_q4(n, k, gen)
            forms["int4_torch"][name].append(Int4Weight.from_codes(codes, d, m + 8 * d))
            dot = Int4DotWeight.from_codes(codes, d, m)
            forms["int4_vnni"][name].append(dot)
            forms["bf16"][name].append(prepack_dense(dot.dequantize().bfloat16()))
    return forms


def layer_pass(form: str, weights: dict[str, list], inputs: dict[str, torch.Tensor]) -> Callable[[], None]:
    """All LAYERS x 4 projections once, as the decode loop calls them (with the casts each form needs)."""
    def run() -> None:
        for layer in range(LAYERS):
            for name in SHAPES:
                w, x = weights[name][layer], inputs[name]
                if form == "int4_torch":
                    w.matmul(x.bfloat16())
                elif form == "bf16":
                    dense_linear(x, w)
                else:
                    w.matmul(x)
    return run


def timed(fn: Callable[[], None], clock: Callable[[], float], min_seconds: float) -> float:
    fn()
    calls, start = 0, clock()
    while True:
        fn()
        calls += 1
        elapsed = clock() - start
        if calls >= 2 and elapsed >= min_seconds:
            return elapsed / calls


def compare(cases: dict[str, Callable[[], None]], rounds: int, clock: Callable[[], float],
            min_seconds: float) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name].append(timed(fn, clock, min_seconds))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=0.1)
    parser.add_argument("--only", choices=["layers", "head"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not int8_dot_available():
        raise SystemExit("the int8-dot kernels do not run natively here (no C++ build, or no AVX512-VNNI)")
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"{args.threads} thread(s), {'thread_time' if args.threads == 1 else 'wall'} ms per pass, median of "
          f"{args.rounds} rounds")
    gen = torch.Generator().manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    with torch.inference_mode():
        if args.only != "head":
            forms = layer_forms(gen)
            print(f"\nlayers: {LAYERS} x (qkv, o_proj, gate_up, down), distinct weights")
            print(f"{'M':>4}" + "".join(f"{form:>12}" for form in forms))
            for m in rows:
                inputs = {name: torch.randn(m, k, generator=gen) for name, (_, k) in SHAPES.items()}
                cases = {form: layer_pass(form, weights, inputs) for form, weights in forms.items()}
                result = compare(cases, args.rounds, clock, args.min_seconds)
                print(f"{m:>4}" + "".join(f"{result[form] * 1e3:>12.3f}" for form in forms), flush=True)
            del forms
        if args.only != "layers":
            codes = torch.randint(-127, 128, (49152, 576), dtype=torch.int8, generator=gen)
            scales = (torch.rand(49152, 18, generator=gen) * 1e-2).half().float()
            heads = {"q8_0": Q8Weight.from_codes(codes, scales), "q8_0_vnni": Q8DotWeight.from_codes(codes, scales)}
            print("\nhead: [M, 576] x [576, 49152]")
            print(f"{'M':>4}" + "".join(f"{form:>12}" for form in heads))
            for m in rows + ([64] if 64 not in rows else []):
                x = torch.randn(m, 576, generator=gen)
                cases = {form: (lambda w=w, x=x: w.matmul(x)) for form, w in heads.items()}
                result = compare(cases, args.rounds, clock, args.min_seconds)
                print(f"{m:>4}" + "".join(f"{result[form] * 1e3:>12.3f}" for form in heads), flush=True)


if __name__ == "__main__":
    main()
