"""The projections of one decode step of a GGUF, kernel by kernel, with the rate each reads its weights at.

Packs every layer's Q/K/V, o_proj, gate/up and down (and the LM head) from the file as the loader does
(`pack_fused` / `pack_linear`, no dense copies), then times runs of "steps": each projection of each layer
in a step's order on `--rows` rows of random activations, so the weights stream from memory as in a decode
step (the file is far larger than the caches). Nothing else of the step runs (no attention, norms,
embedding). Each kind's wall time per step, its bytes and GB/s: the median over `--repeats` runs, and the sum
over its calls of each call's fastest run ("best": on a machine shared with other work, the time a call takes
when nothing else takes its cores or the memory bus; the medians there say more about the others). With
`--compare-stacks`, runs alternate between the row stacks' one call (`int8_dot_stack`) and their parts'
calls one by one plus a concatenation (the path before it), so both see the same machine load; with
`--compare-q4-pack`, also with the file's Q4_K matrices in the Q4 int8-dot pack (5 bits a weight) instead of the
K-quant pack (4.63), as before the K-quant pack took Q4_K.
Usage: python scripts/bench_decode_kernels.py --model FILE [--rows 1] [--repeats 7] [--compare-stacks]
       [--compare-q4-pack]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tokenloop.model.quantized as quantized
from tokenloop.model.ggml_tensor import GGMLTensor
from tokenloop.model.gguf_file import GGUFFile
from tokenloop.model.quantized import PackedLinear, PackThresholds, RowStack, pack_fused, pack_linear

_PROJECTIONS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
                "down": ("ffn_down",)}


def load_packs(path: str) -> tuple[list[tuple[str, PackedLinear]], PackedLinear]:
    """Every layer's projections in a step's order, and the LM head (the tied embedding where no output)."""
    gguf = GGUFFile(path)
    thresholds = PackThresholds(keep_dense=False)

    def tensor(name: str) -> GGMLTensor:
        info = gguf.tensors[name]
        return GGMLTensor.from_raw(info.tensor_type, info.shape, gguf.raw(name))

    layers = 1 + max(int(name.split(".")[1]) for name in gguf.tensors if name.startswith("blk."))
    packs: list[tuple[str, PackedLinear]] = []
    for layer in range(layers):
        for kind, names in _PROJECTIONS.items():
            parts = [tensor(f"blk.{layer}.{name}.weight") for name in names]
            packed = pack_fused(parts, thresholds) if len(parts) > 1 else pack_linear(parts[0], thresholds)
            assert isinstance(packed, PackedLinear), f"layer {layer} {kind}: not packed"
            packs.append((kind, packed))
    head_name = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
    head = pack_linear(tensor(head_name), thresholds)
    assert isinstance(head, PackedLinear)
    return packs, head


def one_by_one(stack: RowStack, x: torch.Tensor) -> torch.Tensor:
    """A row stack as it ran before `int8_dot_stack`: each part's kernel, then a concatenation."""
    return torch.cat([part.matmul(x) for part in stack.parts], dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--compare-stacks", action="store_true")
    parser.add_argument("--compare-q4-pack", action="store_true")
    args = parser.parse_args()
    packs, head = load_packs(args.model)
    arm_packs = {"one call": packs}
    if args.compare_stacks:
        arm_packs["parts + cat"] = packs
    if args.compare_q4_pack:
        kquants = quantized.KQUANT_DOT_TYPES
        quantized.KQUANT_DOT_TYPES = tuple(t for t in kquants if t != GGMLQuantizationType.Q4_K)
        try:
            arm_packs["Q4_K as Q4 pack"] = load_packs(args.model)[0]
        finally:
            quantized.KQUANT_DOT_TYPES = kquants
    arms = tuple(arm_packs)
    generator = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(args.rows, n, generator=generator) for n in {p.packed.in_features for _, p in packs}}
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    best: dict[tuple[str, int], float] = {}  # (arm, call) -> its fastest run
    call_kind: dict[tuple[str, int], str] = {}  # (arm, call) -> its kind
    kind_bytes: dict[tuple[str, str], int] = defaultdict(int)  # (arm, kind)
    with torch.inference_mode():
        for repeat in range(args.repeats + 1):  # the first run warms up
            for arm in arms:
                spent: dict[str, float] = defaultdict(float)
                for call, (kind, packed) in enumerate(arm_packs[arm]):
                    x = inputs[packed.packed.in_features]
                    name = call_kind[arm, call] = f"{kind} ({packed.form})"
                    start = time.perf_counter()
                    if arm == "parts + cat" and isinstance(packed.packed, RowStack):
                        one_by_one(packed.packed, x)
                    else:
                        packed.native(x)
                    took = time.perf_counter() - start
                    spent[name] += took
                    if repeat:
                        best[arm, call] = min(best.get((arm, call), took), took)
                    if repeat == 0:
                        kind_bytes[arm, name] += packed.packed.nbytes
                x = inputs[head.packed.in_features]
                start = time.perf_counter()
                head.native(x)
                took = time.perf_counter() - start
                call_kind[arm, len(packs)] = f"lm head ({head.form})"
                spent[call_kind[arm, len(packs)]] += took
                if repeat:
                    best[arm, len(packs)] = min(best.get((arm, len(packs)), took), took)
                if repeat == 0:
                    kind_bytes[arm, f"lm head ({head.form})"] = head.packed.nbytes
                if repeat:
                    for name, seconds in spent.items():
                        times[arm, name].append(seconds)
    print(f"{args.model}: {args.rows} row(s), {torch.get_num_threads()} threads, medians of {args.repeats} runs, "
          f"wall ms a step; load average {os.getloadavg()[0]:.1f}")
    for arm in arms:
        names = sorted({name for a, name in times if a == arm}, key=lambda n: -statistics.median(times[arm, n]))
        fastest = {name: sum(t for (a, call), t in best.items() if a == arm and call_kind[a, call] == name)
                   for name in names}
        total, total_best = (sum(statistics.median(times[arm, name]) for name in names), sum(fastest.values()))
        moved = sum(kind_bytes[arm, n] for n in names)
        print(f"## {arm}: {moved / 1e6:.1f} MB; median {total * 1e3:.2f} ms ({moved / total / 1e9:.1f} GB/s), "
              f"best {total_best * 1e3:.2f} ms ({moved / total_best / 1e9:.1f} GB/s)")
        for name in names:
            median = statistics.median(times[arm, name])
            moved = kind_bytes[arm, name]
            print(f"  {name:<30}{moved / 1e6:7.1f} MB  median {median * 1e3:7.2f} ms "
                  f"{moved / median / 1e9:5.1f} GB/s  best {fastest[name] * 1e3:6.2f} ms "
                  f"{moved / fastest[name] / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
