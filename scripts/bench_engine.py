"""Offline engine benchmark on the default model, side by side in one run.

1. `LLM.generate` on N seeded requests (prompts 16-512 tokens, outputs 32-256, random token ids,
   ignore_eos so lengths are fixed) vs HF transformers static batching of the same prompts:
   output tok/s and total tok/s; the decode rate while 32 requests run; engine overhead per step.
2. Prefix caching: 32 requests sharing a 256-token system prompt, with and without the cache.

Usage: python scripts/bench_engine.py [--num-requests 64] [--no-hf] [--skip-prefix]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch

from tokenloop import LLM, SamplingParams
from tokenloop.model.loader import load_checkpoint, resolve_model_path
from tokenloop.observe.records import EngineObserver, StepRecord


def make_workload(num: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    # Skip the first ids: special tokens would only add noise to the prompts.
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(16, 512))], rng.randint(32, 256))
            for _ in range(num)]


class _Step:
    """One step's numbers from its record, in seconds."""

    def __init__(self, record: StepRecord) -> None:
        self.num_scheduled = record.num_scheduled
        self.num_batched_tokens = record.num_batched_tokens
        self.total_s = (record.end_ns - record.start_ns) / 1e9
        self.overhead_s = self.total_s - record.forward_ns / 1e9


def run_tokenloop(llm: LLM, workload: list[tuple[list[int], int]]) -> dict[str, float]:
    engine = llm.engine
    for i, (prompt, out_len) in enumerate(workload):
        engine.add_request(f"b{i}", None, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True),
                           prompt_token_ids=prompt)
    records: list[StepRecord] = []

    class Collect(EngineObserver):
        def on_step(self, record: StepRecord) -> None:
            records.append(record)

    engine.add_observer(Collect())
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    steps = [_Step(r) for r in records]
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p, _ in workload)
    output_tokens = sum(n for _, n in workload)
    full_decode = [s for s in steps if s.num_scheduled == 32 and s.num_batched_tokens == 32]
    decode_time = sum(s.total_s for s in full_decode)
    batch32 = [s for s in steps if s.num_scheduled >= 32]
    return {
        "elapsed_s": elapsed,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
        "decode32_tok_s": 32 * len(full_decode) / decode_time if full_decode else float("nan"),
        "decode32_steps": len(full_decode),
        "overhead_frac_b32": (sum(s.overhead_s for s in batch32) / sum(s.total_s for s in batch32)
                              if batch32 else float("nan")),
        "overhead_ms_b32": 1e3 * statistics.mean(s.overhead_s for s in batch32) if batch32 else float("nan"),
        "step_ms_b32": 1e3 * statistics.mean(s.total_s for s in batch32) if batch32 else float("nan"),
        "steps": len(steps),
    }


def run_hf_static(hf, workload: list[tuple[list[int], int]], batch_size: int, pad_id: int) -> dict[str, float]:
    """Static batching: each batch is left-padded and runs until its longest output is done."""
    start = time.perf_counter()
    for begin in range(0, len(workload), batch_size):
        batch = workload[begin:begin + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        longest = max(n for _, n in batch)
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                        pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p, _ in workload)
    output_tokens = sum(n for _, n in workload)
    return {"elapsed_s": elapsed, "output_tok_s": output_tokens / elapsed,
            "total_tok_s": (prompt_tokens + output_tokens) / elapsed}


def run_prefix(checkpoint, enable: bool, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    vocab = checkpoint.config.vocab_size
    system = [rng.randrange(100, vocab) for _ in range(256)]
    llm = LLM(checkpoint=checkpoint, max_num_seqs=32, max_num_batched_tokens=512, enable_prefix_caching=enable)
    prompts = [{"prompt_token_ids": system + [rng.randrange(100, vocab) for _ in range(rng.randint(8, 32))]}
               for _ in range(32)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.engine.stats()
    total = sum(len(p["prompt_token_ids"]) + 32 for p in prompts)
    return {"elapsed_s": elapsed, "total_tok_s": total / elapsed,
            "mean_ttft_s": statistics.mean(o.metrics.ttft_s for o in outputs),
            "hit_rate": stats.prefix_cache_hit_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--skip-prefix", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--weight-dtype", default=None, choices=["float32", "bfloat16"])
    args = parser.parse_args()

    checkpoint = load_checkpoint(args.model)
    workload = make_workload(args.num_requests, checkpoint.config.vocab_size, args.seed)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"workload: {len(workload)} requests, prompts {sum(len(p) for p, _ in workload)} tokens, "
          f"outputs {sum(n for _, n in workload)} tokens (seed {args.seed})")
    llm = LLM(checkpoint=checkpoint, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
              weight_dtype=args.weight_dtype)
    ours = run_tokenloop(llm, workload)
    print(f"tokenloop (dtype {args.dtype}, weights {args.weight_dtype or args.dtype}): "
          f"{ours['elapsed_s']:.1f} s, output {ours['output_tok_s']:.1f} tok/s, "
          f"total {ours['total_tok_s']:.1f} tok/s; decode with 32 running {ours['decode32_tok_s']:.1f} tok/s "
          f"over {ours['decode32_steps']} steps; at batch>=32: step {ours['step_ms_b32']:.1f} ms, "
          f"overhead {ours['overhead_ms_b32']:.1f} ms ({100 * ours['overhead_frac_b32']:.1f}%)", flush=True)
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(args.model)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        theirs = run_hf_static(hf, workload, args.max_num_seqs, checkpoint.tokenizer.eos_token_id)
        print(f"HF static batching ({args.max_num_seqs}/batch): {theirs['elapsed_s']:.1f} s, "
              f"output {theirs['output_tok_s']:.1f} tok/s, total {theirs['total_tok_s']:.1f} tok/s", flush=True)
    if not args.skip_prefix:
        for enable in (False, True):
            r = run_prefix(checkpoint, enable, args.seed)
            print(f"prefix cache {'on ' if enable else 'off'}: {r['elapsed_s']:.1f} s, "
                  f"total {r['total_tok_s']:.1f} tok/s, "
                  f"mean TTFT {r['mean_ttft_s'] * 1e3:.0f} ms, hit rate {100 * r['hit_rate']:.1f}%", flush=True)


if __name__ == "__main__":
    main()
