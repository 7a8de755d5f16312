"""Forward throughput of the default model: decode at batch 1, 8, 32 and a 512-token prefill.

Side by side with HF transformers (same GGUF, fp32) in the same run, since this machine is noisy.
Usage: python scripts/bench_forward.py [--context 128] [--steps 8] [--no-hf]
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Callable

import torch

from tokenloop.model.attention import AttentionMetadata
from tokenloop.model.llama import LlamaModel
from tokenloop.model.loader import load_checkpoint, resolve_model_path


def _best_of(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def tokenloop_decode(model: LlamaModel, batch: int, context: int, steps: int, repeats: int) -> float:
    return batch * steps / _best_of(make_decode_run(model, batch, context, steps), repeats)


def make_decode_run(model: LlamaModel, batch: int, context: int, steps: int) -> Callable[[], None]:
    """Cache `context` tokens for `batch` sequences (untimed); return a run of `steps` decode steps."""
    block_size = 16
    blocks_per_seq = (context + steps + block_size) // block_size
    kv = model.allocate_kv_cache(batch * blocks_per_seq + 1, block_size)
    table = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    # Fill the context with one ragged-free prefill per sequence (not timed).
    for row in range(batch):
        ids = torch.randint(vocab, (context,), generator=generator)
        pos = torch.arange(context)
        slots = table[row, pos // block_size] * block_size + pos % block_size
        meta = AttentionMetadata.build([0, context], [context], table[row:row + 1], slots, block_size)
        model.forward(ids, pos, meta, kv, torch.tensor([context - 1]))

    def run() -> None:
        for step in range(steps):
            length = context + step
            pos = torch.full((batch,), length)
            slots = table[:, length // block_size] * block_size + length % block_size
            meta = AttentionMetadata.build(list(range(batch + 1)), [length + 1] * batch, table, slots, block_size,
                                           model.decode_kernel)
            model.forward(torch.randint(vocab, (batch,), generator=generator), pos, meta, kv,
                          torch.arange(batch))

    return run


def tokenloop_prefill(model: LlamaModel, length: int, repeats: int) -> float:
    block_size = 16
    kv = model.allocate_kv_cache(length // block_size + 1, block_size)
    table = torch.arange(length // block_size + 1).view(1, -1)
    ids = torch.randint(model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(length)
    meta = AttentionMetadata.build([0, length], [length], table, pos.clone(), block_size)
    return length / _best_of(lambda: model.forward(ids, pos, meta, kv, torch.tensor([length - 1])), repeats)


def hf_decode(hf, batch: int, context: int, steps: int, repeats: int) -> float:
    from transformers import DynamicCache

    vocab = hf.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(vocab, (batch, context), generator=generator)

    def run() -> None:
        cache = DynamicCache()
        hf(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        start = time.perf_counter()
        for _ in range(steps):
            hf(torch.randint(vocab, (batch, 1), generator=generator), past_key_values=cache, use_cache=True)
        run.decode_time = time.perf_counter() - start  # type: ignore[attr-defined]

    best = float("inf")
    run()
    for _ in range(repeats):
        run()
        best = min(best, run.decode_time)  # type: ignore[attr-defined]
    return batch * steps / best


def hf_prefill(hf, length: int, repeats: int) -> float:
    ids = torch.randint(hf.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    return length / _best_of(lambda: hf(ids, use_cache=False, logits_to_keep=1), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=128, help="tokens already cached per decode sequence")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the best is kept")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="tokenloop's activations and KV cache (HF always runs float32)")
    parser.add_argument("--weight-dtype", default=None, choices=["float32", "bfloat16"],
                        help="tokenloop's projection weights (default: --dtype)")
    args = parser.parse_args()
    torch.manual_seed(0)

    start = time.perf_counter()
    checkpoint = load_checkpoint(args.model)
    load_s = time.perf_counter() - start
    model = LlamaModel.from_weights(checkpoint.config, checkpoint.weights, dtype=getattr(torch, args.dtype),
                                    weight_dtype=getattr(torch, args.weight_dtype) if args.weight_dtype else None)
    ready_s = time.perf_counter() - start
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(args.model)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        hf.eval()

    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}); tokenloop dtype {args.dtype}, weights {args.weight_dtype or args.dtype}")
    print(f"tokenloop load (config + weights + tokenizer): {load_s:.2f} s; model ready: {ready_s:.2f} s "
          f"(includes building the C++ decode kernel on a machine's first run: "
          f"{'on' if model.decode_kernel is not None else 'off'})")
    print(f"{'case':<24}{'tokenloop tok/s':>16}{'HF tok/s':>12}")
    with torch.inference_mode():
        for batch in [int(b) for b in args.batches.split(",")]:
            ours = tokenloop_decode(model, batch, args.context, args.steps, args.repeats)
            theirs = hf_decode(hf, batch, args.context, args.steps, args.repeats) if hf else float("nan")
            print(f"{f'decode batch {batch}':<24}{ours:>16.1f}{theirs:>12.1f}", flush=True)
        ours = tokenloop_prefill(model, args.prefill, args.repeats)
        theirs = hf_prefill(hf, args.prefill, args.repeats) if hf else float("nan")
        print(f"{f'prefill {args.prefill}':<24}{ours:>16.1f}{theirs:>12.1f}", flush=True)


if __name__ == "__main__":
    main()
