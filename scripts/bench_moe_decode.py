"""Offline decode speed of a mixture-of-experts GGUF (scripts/make_moe_gguf.py) in the engine, and the share
of the expert bytes each decode step's MoE layers read (what grouping tokens by expert saves):

    scripts/bench_moe_decode.py MODEL.gguf [--batches 1 8] [--tokens 64]

Each batch size runs one warm-up request set, then `--tokens` greedy tokens per stream (ignore_eos) from
32-token prompts; tok/s counts output tokens over the wall time of the whole generate call (prefill included).
The expert share is measured on the decode steps (one row a stream): bytes of the experts the step's tokens
chose over the bytes of all experts, averaged over layers and steps.
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenloop import LLM, SamplingParams
from tokenloop.model.layers import moe as moe_layer
from tokenloop.model.models import qwen3_moe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    start = time.perf_counter()
    llm = LLM(args.model, max_model_len=1024)
    model = llm.engine.model
    print(f"loaded in {time.perf_counter() - start:.0f} s: {type(model).__name__}, experts "
          f"{model.weight_form(1)}, {torch.get_num_threads()} threads")
    shares: list[float] = []
    block = qwen3_moe.moe_block  # the MoE families' layer calls it by this name
    decode_rows = 0

    def measured(x: torch.Tensor, weights: moe_layer.MoEWeights) -> torch.Tensor:
        if x.shape[0] == decode_rows:
            read, total = moe_layer.active_expert_bytes(x, weights)
            shares.append(read / total)
        return block(x, weights)

    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for batch in args.batches:
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 5000 + 10 for j in range(32)]}
                   for i in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        decode_rows, shares = batch, []
        qwen3_moe.moe_block = measured  # the share, on a separate short run (measuring costs a routing pass)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        qwen3_moe.moe_block = block
        share = sum(shares) / max(len(shares), 1)
        print(f"batch {batch}: {tokens / elapsed:.1f} output tok/s ({elapsed:.1f} s for {tokens} tokens); "
              f"a decode step's MoE layers read {100 * share:.1f}% of the expert bytes")


if __name__ == "__main__":
    main()
