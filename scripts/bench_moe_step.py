"""One pure decode step of a mixture-of-experts GGUF (scripts/make_moe_gguf.py) by path, the paths alternated
in one process so that all see the same machine: the model's forward alone (no scheduler, sampler or server),
the same step repeated `--reps` times a round, its fastest and median time reported (the fastest is the one
least disturbed by other processes on a shared machine):

    PYTHONPATH=. python scripts/bench_moe_step.py MODEL.gguf [--batches 1 8] [--context 64] [--reps 20]
        [--rounds 3] [--paths loop fused ops]

Paths: `loop` every layer in one C++ call (`decode_layers`, the MoE blocks inside it), `fused` the fused
kernels layer by layer with the native MoE call, `ops` the per-layer op path with the native MoE call (the MoE
families' path before branch moe3).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from tokenloop import LLM
from tokenloop.model.attention import AttentionMetadata

BLOCK_SIZE = 16


def decode_step(model: Any, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, Any]:
    """A KV cache holding `batch` prompts of `context` tokens (prefilled on the model's own path) and the
    arguments of the next decode step over them: (token ids, positions, layout, KV cache)."""
    blocks_each = (context + BLOCK_SIZE) // BLOCK_SIZE + 1
    kv = model.allocate_kv_cache(batch * blocks_each, BLOCK_SIZE)
    table = torch.arange(batch * blocks_each).view(batch, blocks_each)
    gen = torch.Generator().manual_seed(batch)
    pos = torch.arange(context)
    for row in range(batch):
        slots = table[row, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        meta = AttentionMetadata.build([0, context], [context], table[row:row + 1], slots, BLOCK_SIZE)
        model.forward(torch.randint(model.config.vocab_size, (context,), generator=gen), pos, meta, kv)
    slots = table[:, context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE
    meta = AttentionMetadata.build(list(range(batch + 1)), [context + 1] * batch, table, slots, BLOCK_SIZE,
                                   model.decode_kernel)
    ids = torch.randint(model.config.vocab_size, (batch,), generator=gen)
    return ids, torch.full((batch,), context), meta, kv


def set_path(model: Any, path: str, fused_ops: Any, fused_decode: bool) -> None:
    model.fused_ops = fused_ops if path in ("loop", "fused") else None
    model.fused_decode = fused_decode and path == "loop"


def agreement(model: Any, paths: list[str], step: tuple[Any, ...], fused_ops: Any, fused_decode: bool) -> str:
    """How far each path's logits for the step lie from the first path's: max |difference| / max |logit|, and
    whether every row's top token is the same."""
    logits = {}
    for path in paths:
        set_path(model, path, fused_ops, fused_decode)
        logits[path] = model.forward(*step)
    first = logits[paths[0]]
    scale = first.abs().max()
    return "; ".join(f"{path} vs {paths[0]}: max |diff| / max |logit| {(out - first).abs().max() / scale:.1e}, "
                     f"same top token {bool((out.argmax(-1) == first.argmax(-1)).all())}"
                     for path, out in logits.items() if path != paths[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paths", nargs="+", choices=["loop", "fused", "ops"], default=["loop", "fused", "ops"])
    args = parser.parse_args()
    model: Any = LLM(args.model, max_model_len=1024).engine.model
    fused_ops, fused_decode = model.fused_ops, model.fused_decode
    print(f"{torch.get_num_threads()} threads; experts {model.weight_form(1)}; one-call loop available: "
          f"{fused_decode}")
    print("| streams | path | fastest ms | median ms | rounds' medians |\n|---:|---|---:|---:|---|")
    for batch in args.batches:
        ids, positions, meta, kv = decode_step(model, batch, args.context)
        times: dict[str, list[float]] = {path: [] for path in args.paths}
        medians: dict[str, list[float]] = {path: [] for path in args.paths}
        for _ in range(args.rounds):
            for path in args.paths:
                set_path(model, path, fused_ops, fused_decode)
                model.forward(ids, positions, meta, kv)  # warm: plans, caches
                round_times = []
                for _ in range(args.reps):
                    start = time.perf_counter()
                    model.forward(ids, positions, meta, kv)
                    round_times.append(1e3 * (time.perf_counter() - start))
                times[path] += round_times
                medians[path].append(statistics.median(round_times))
        for path in args.paths:
            print(f"| {batch} | {path} | {min(times[path]):.2f} | {statistics.median(times[path]):.2f} | "
                  + " / ".join(f"{m:.1f}" for m in medians[path]) + " |")
        print(f"streams {batch}: " + agreement(model, args.paths, (ids, positions, meta, kv), fused_ops, fused_decode))
    set_path(model, "loop", fused_ops, fused_decode)


if __name__ == "__main__":
    main()
