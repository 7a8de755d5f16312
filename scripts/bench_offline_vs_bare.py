"""One stream's offline inter-token latency next to the bare decode step of the same model, in one process.

`LLM.generate` (the engine loop in-process: scheduler, runner, sampler, detokenizer) and the model's own forward
(`bench_forward.make_decode_run`: one pure decode step, logits included, no engine) take turns on one loaded
model, so both see the same machine load. Whatever the ITL costs beyond the bare step is the engine loop's.
Usage: python scripts/bench_offline_vs_bare.py --model FILE [--tokens 16] [--context 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_forward import make_decode_run
from tokenloop import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated a run")
    parser.add_argument("--context", type=int, default=128, help="the bare step's cached context")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype="auto")
    model = llm.engine.core.model
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    prompt = list(range(100, 100 + args.context))  # token ids: the same context length as the bare step's
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)  # warm-up: kernels, plans, caches
    with torch.inference_mode():
        bare = make_decode_run(model, 1, args.context, args.tokens)
        bare()
    itls, steps = [], []
    for _ in range(args.repeats):
        output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        itls += list(output.metrics.itls_s)
        with torch.inference_mode():
            start = time.perf_counter()
            bare()
            steps.append((time.perf_counter() - start) / args.tokens)
    itl, step = statistics.median(itls) * 1e3, statistics.median(steps) * 1e3
    print(f"load average {os.getloadavg()[0]:.1f}; one stream, ms: offline ITL median {itl:.1f} "
          f"(min {min(itls) * 1e3:.1f}), bare decode step median {step:.1f} (min {min(steps) * 1e3:.1f}): "
          f"ITL / step {itl / step:.2f}x")


if __name__ == "__main__":
    main()
