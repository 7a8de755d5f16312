"""Offline greedy decode speed of any served model at a few stream counts, from the tree it runs in.

Usage: PYTHONPATH=<tree> python scripts/bench_offline_decode.py MODEL [--streams 1 8] [--tokens 64] [--runs 2]

Per stream count: one warm-up generate, then `--runs` generates of `--tokens` greedy tokens per stream (EOS
ignored) from short distinct prompts; tok/s counts output tokens over the generate call's wall time (the short
prompts' prefill included) and the best run is reported with all runs beside it, with the process's CPU
time per output token (user + system, all threads) of that run: on a machine shared with other work the wall
time swings with their load; with OMP_NUM_THREADS=1 the CPU time measures this process's own work. Run two
trees alternated (A B A B) to compare them.
"""

from __future__ import annotations

import argparse
import time

from tokenloop import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype="auto")
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for streams in args.streams:
        prompts = [f"Story number {i}: once upon a time" for i in range(streams)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: kernels, plans, caches
        rates, cpu_ms = [], []
        for _ in range(args.runs):
            begin, cpu_begin = time.perf_counter(), time.process_time()
            llm.generate(prompts, params, use_tqdm=False)
            rates.append(args.tokens * streams / (time.perf_counter() - begin))
            cpu_ms.append((time.process_time() - cpu_begin) * 1e3 / (args.tokens * streams))
        best = max(range(args.runs), key=rates.__getitem__)
        print(f"streams={streams} tok/s={rates[best]:.1f} cpu_ms_per_token={cpu_ms[best]:.2f} (runs "
              f"{', '.join(f'{r:.1f}' for r in rates)}; cpu ms {', '.join(f'{c:.2f}' for c in cpu_ms)})", flush=True)


if __name__ == "__main__":
    main()
