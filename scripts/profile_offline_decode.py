"""Where one stream's offline greedy decoding goes, by PyTorch op (torch.profiler), for any served model.

Usage: python scripts/profile_offline_decode.py --model FILE [--tokens 48] [--rows 18]
Prints offline tok/s (prefill included) and the ops with the most self CPU time over one profiled generate.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.profiler import ProfilerActivity, profile

from tokenloop import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rows", type=int, default=18, help="ops to list")
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype="auto")
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(["Once upon a time"], params)  # warm-up: kernels, caches
    begin = time.perf_counter()
    llm.generate(["Once upon a time"], params)
    elapsed = time.perf_counter() - begin
    print(f"offline, one stream: {args.tokens / elapsed:.1f} tok/s ({elapsed / args.tokens * 1e3:.1f} ms a token, "
          "prefill included)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(["Once upon a time"], params)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
