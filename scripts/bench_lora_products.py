"""One decode step's LoRA products on the default model's shapes, native kernel vs the PyTorch path.

    PYTHONPATH=. python scripts/bench_lora_products.py [--rows 8] [--adapters 8] [--repeat 7]

`--rows` tokens spread over `--adapters` random rank-16 adapters (bf16, all seven projections), every
layer's four fused projections as a step runs them; wall time and process CPU time (which a busy machine's
descheduling does not inflate) per step, median and minimum over `--repeat` steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from tokenloop.model.loader import DEFAULT_MODEL, load_checkpoint
from tokenloop.model.lora import FUSED_PROJECTIONS, LoRAAdapter, projection_shapes
from tokenloop.model.lora_slots import AdapterSlots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    config = load_checkpoint(DEFAULT_MODEL).config
    shapes = projection_shapes(config)
    slots = AdapterSlots(config, args.adapters, 16, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for index in range(args.adapters):
        layers = [{module: (torch.randn(16, inp, generator=gen).bfloat16(),
                            torch.randn(out, 16, generator=gen).bfloat16()) for module, (out, inp) in shapes.items()}
                  for _ in range(config.num_layers)]
        slots.register(LoRAAdapter(f"a{index}", "-", 16, 1.0, tuple(shapes), layers))
    slot_of = slots.slots_for([f"a{index}" for index in range(args.adapters)])
    batch = slots.batch(np.array([slot_of[f"a{row % args.adapters}"] for row in range(args.rows)]))
    assert batch is not None
    xs = {kind: torch.randn(args.rows, slots.a[0][kind].shape[1]).bfloat16() for kind in FUSED_PROJECTIONS}
    outs = {kind: torch.zeros(args.rows, slots.bt[0][kind].shape[1], dtype=torch.bfloat16)
            for kind in FUSED_PROJECTIONS}
    paths = {"native": batch.add_, "pytorch": batch.add_reference_}
    if batch.kernel is None:
        del paths["native"]
        print("the C++ kernels are not built here: the PyTorch path only")
    for name, add in paths.items():
        wall, cpu = [], []
        for repeat in range(args.repeat + 1):
            begin, begin_cpu = time.perf_counter(), time.process_time()
            for layer in range(config.num_layers):
                for kind in FUSED_PROJECTIONS:
                    add(outs[kind], xs[kind], layer, kind)
            if repeat:  # the first one warms up
                wall.append((time.perf_counter() - begin) * 1e3)
                cpu.append((time.process_time() - begin_cpu) * 1e3)
        print(f"{name}: {args.rows} rows over {args.adapters} adapters, one step (30 layers x 4 projections): "
              f"wall median {statistics.median(wall):.2f} ms (min {min(wall):.2f}), CPU median "
              f"{statistics.median(cpu):.2f} ms (min {min(cpu):.2f}), {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
