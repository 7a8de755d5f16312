"""Greedy tokens of the default model with adapters in int8 slots against bf16 (and float32) slots (issue 32).

    PYTHONPATH=. python -u scripts/check_lora_int8.py [--adapters 4] [--tokens 48]

With `--lora-dtype int8` a packed (quantized) base keeps its adapters' A and B^T in int8 with row scales
(core/adapters.py `adapter_dtype`; by default in bf16). What that changes for users: every (prompt, adapter)
pair's greedy tokens, one batch per slot dtype, the same checkpoint and batch shapes each time. Two kinds of
rank-16 adapter on all seven projections: the benchmark's (entries of std 0.01, alpha 32) and one shaped as a
trained PEFT adapter (A as PEFT initializes it, uniform within 1/sqrt(in); B of std 0.02 with rows of uneven
size; alpha 32), which moves the base model's tokens more. Prints, per kind, how many sequences equal the bf16
slots' token for token, the share of tokens before the first difference, the reference's top-2 logprob margin
where they part, and for scale the same for bf16 against float32 slots and against the base model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

import tokenloop.core.engine_core as engine_core
from scripts.bench_lora import write_adapter
from tokenloop import LLM, LoRARequest, SamplingParams
from tokenloop.model.loader import DEFAULT_MODEL, load_checkpoint
from tokenloop.model.lora import _MODULE_PREFIX, projection_shapes

PROMPTS = [
    "The capital of France is", "Write a haiku about the sea.", "Explain photosynthesis to a child.",
    "def fibonacci(n):", "List three uses of copper.", "Once upon a time, in a small village,",
    "The best way to learn a language is", "Translate to German: good morning, my friend.",
    "What causes the seasons on Earth?", "A recipe for pancakes needs", "The history of the bicycle",
    "Why is the sky blue?", "Dear hiring manager, I am writing to", "import numpy as np\n",
    "Summarize the plot of Hamlet.", "The three laws of motion are",
]


def write_trained_like(directory: Path, config, rank: int, seed: int) -> Path:
    """A PEFT directory shaped as a trained adapter: A uniform within 1/sqrt(in) (PEFT's init), B of std 0.02
    with each output row scaled by 0.25-2 (trained B rows are of uneven size)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (out_features, in_features) in projection_shapes(config).items():
            key = f"base_model.model.model.layers.{layer}.{_MODULE_PREFIX[module]}.{module}"
            bound = in_features ** -0.5
            tensors[key + ".lora_A.weight"] = (torch.rand(rank, in_features, generator=gen) * 2 - 1) * bound
            rows = 0.25 + 1.75 * torch.rand(out_features, 1, generator=gen)
            tensors[key + ".lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.02 * rows
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(_MODULE_PREFIX)}))
    return directory


Run = list[tuple[list[int], list[float]]]  # per sequence: greedy tokens, the top-2 logprob margin at each


def greedy(checkpoint, dirs: dict[str, Path], slots: str, tokens: int, pairs: list[tuple[str, str | None]]) -> Run:
    """Each (prompt, adapter) pair's greedy tokens in one batch, with the adapters in slots as `--lora-dtype
    slots` keeps them ("float32": float32 slots, which no option gives a packed base: set here from outside),
    and at each token the gap between the best and second logprob."""
    chosen = engine_core.adapter_dtype
    if slots == "float32":
        engine_core.adapter_dtype = lambda choice, requested: torch.float32  # type: ignore[assignment]
    try:
        llm = LLM(DEFAULT_MODEL, checkpoint=checkpoint, lora_modules={n: str(d) for n, d in dirs.items()},
                  max_loras=len(dirs), max_lora_rank=16, max_num_seqs=len(pairs),
                  lora_dtype="auto" if slots == "float32" else slots)
    finally:
        engine_core.adapter_dtype = chosen
    print(f"  slots: {llm.engine.core.adapters.slots.dtype}")
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=2)
    outputs = llm.generate([p for p, _ in pairs], params,
                           lora_request=[LoRARequest(a) if a else None for _, a in pairs], use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [t.top[0][1] - t.top[1][1] for t in o.outputs[0].logprobs or []])
            for o in outputs]


def compare(label: str, got: Run, want: Run) -> str:
    """How many sequences are equal, the share of tokens before each sequence's first difference, and the
    reference run's top-2 margin where they part (a near tie there: any rounding may tip it)."""
    parted = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for (g, _), (w, _) in zip(got, want)]
    before = sum(len(w) if i is None else i for i, (w, _) in zip(parted, want))
    margins = sorted(m[i] for i, (_, m) in zip(parted, want) if i is not None)
    where = f"; the reference's top-2 margin there: median {margins[len(margins) // 2]:.3f}, max " \
            f"{margins[-1]:.3f} (all tokens' median {statistics.median(m for _, ms in want for m in ms):.2f})" \
        if margins else ""
    return f"{label}: {parted.count(None)}/{len(want)} sequences equal, " \
           f"{before / sum(len(w) for w, _ in want):.1%} of tokens before the first difference{where}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=4, help="of each kind")
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    checkpoint = load_checkpoint(DEFAULT_MODEL, keep_quantized=True)  # packed, as served
    config = checkpoint.config
    with tempfile.TemporaryDirectory() as tmp:
        for kind, write in (("benchmark (std 0.01)", write_adapter), ("trained-like", write_trained_like)):
            dirs = {f"ad{i}": write(Path(tmp) / f"{kind[:5]}{i}", config, 16, i) for i in range(args.adapters)}
            pairs = [(prompt, f"ad{i % args.adapters}") for i, prompt in enumerate(PROMPTS)]
            pairs += [(prompt, f"ad{(i + 1) % args.adapters}") for i, prompt in enumerate(PROMPTS)]
            print(f"{kind} adapters, {len(pairs)} (prompt, adapter) pairs x {args.tokens} greedy tokens:")
            runs = {slots: greedy(checkpoint, dirs, slots, args.tokens, pairs) for slots in ("int8", "auto", "float32")}
            base = greedy(checkpoint, dirs, "auto", args.tokens, [(p, None) for p, _ in pairs])
            print("  " + compare("int8 slots vs bf16 slots (auto)", runs["int8"], runs["auto"]))
            print("  " + compare("bf16 slots vs float32 slots", runs["auto"], runs["float32"]))
            print("  " + compare("int8 slots vs float32 slots", runs["int8"], runs["float32"]))
            print("  " + compare("bf16 slots vs the base model", runs["auto"], base))


if __name__ == "__main__":
    main()
