"""One MoE layer at OLMoE-1B-7B's shape, the native call (csrc/moe_experts.cpp) next to the op path
(`grouped_moe_block`), alternated in one run:

    PYTHONPATH=. python scripts/bench_moe_layer.py [--tokens 1 8] [--layers 4] [--down q6_k] [--rounds 5]

Random packs (speed does not depend on the values): 64 experts of hidden 2048 and width 1024, 8 active, gate/up
in the int4-dot form a Q4_K file packs to, down in Q4_K's or Q6_K's. `--layers` distinct layers are cycled so
that the experts stream from memory as in a decode step. Prints ms a layer (median of the rounds) and the active
experts' bytes over that time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.int8_dot import TILE, Int4DotWeight
from tokenloop.model.kquant_dot import KQuantDotWeight
from tokenloop.model.layers.moe import MoEWeights, active_expert_bytes, grouped_moe_block, moe_block
from tokenloop.model.quantized import PackedLinear

HIDDEN, WIDTH, EXPERTS, TOP_K = 2048, 1024, 64, 8


def random_pack(n: int, k: int, down_kind: str | None, gen: torch.Generator) -> PackedLinear:
    tiles, groups = n // TILE, k // 32
    if down_kind == "q6_k":
        codes = torch.randint(0, 256, (tiles, groups, 256 + 128 + 32), dtype=torch.uint8, generator=gen)
        scales = (torch.rand(tiles, k // 256, 1, TILE, generator=gen) * 1e-3).half()
        pack: Int4DotWeight | KQuantDotWeight = KQuantDotWeight(codes, scales, n, 6)
    else:
        codes = torch.randint(0, 256, (tiles, groups, 256), dtype=torch.uint8, generator=gen)
        scales = (torch.rand(tiles, groups, 2, TILE, generator=gen) * 1e-2 - 5e-3).half()
        pack = Int4DotWeight(codes, scales, n, k)
    return PackedLinear(pack, None, 1 << 30)


def random_layer(down_kind: str, seed: int) -> MoEWeights:
    gen = torch.Generator().manual_seed(seed)
    return MoEWeights(router=torch.randn(EXPERTS, HIDDEN, generator=gen) * HIDDEN ** -0.5,
                      gate_up=[random_pack(2 * WIDTH, HIDDEN, None, gen) for _ in range(EXPERTS)],
                      down=[random_pack(HIDDEN, WIDTH, down_kind, gen) for _ in range(EXPERTS)],
                      top_k=TOP_K, normalize=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--down", choices=["q4_k", "q6_k"], default="q4_k")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="passes over the layers a round")
    args = parser.parse_args()
    assert paged_decode_kernels() is not None
    layers = [random_layer(args.down, seed) for seed in range(args.layers)]
    print(f"{torch.get_num_threads()} threads; {args.layers} layers; down {args.down}")
    paths = {"ops": grouped_moe_block, "native": moe_block}
    for tokens in args.tokens:
        xs = [torch.randn(tokens, HIDDEN) for _ in range(args.steps)]
        read = sum(active_expert_bytes(x, layer)[0] for x in xs for layer in layers) / (len(xs) * len(layers))
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, block in paths.items():
                start = time.perf_counter()
                for x in xs:
                    for layer in layers:
                        block(x, layer)
                times[name].append((time.perf_counter() - start) / (len(xs) * len(layers)))
        for name, samples in times.items():
            ms = statistics.median(samples) * 1e3
            print(f"tokens {tokens} {name:>6}: {ms:.3f} ms a layer (rounds {min(samples) * 1e3:.3f}-"
                  f"{max(samples) * 1e3:.3f}); active experts {read / 1e6:.1f} MB -> {read / ms / 1e6:.1f} GB/s")


if __name__ == "__main__":
    main()
