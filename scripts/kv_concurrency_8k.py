"""How many 8,192-token requests the default KV pool holds at once (issue 29's Gemma 3 goal), counted by the real
engine core with the forward stood in.

The engine is built for FILE as `tokenloop serve` builds it (dtype auto, the default 1 GiB KV pool, the default
prefill chunk), then its model runner is replaced by the simulator's (`tokenloop.sim.runner.SimulatedRunner`: one
dictated token a sampling row, no forward), so the scheduler, the KV groups' block tables and their sliding-window
release run as served while the steps cost nothing. `--requests` prompts of `--tokens` tokens arrive at once, each
generating `--decode` tokens; every step records how many requests run, how many have finished their prefill
(decoding), the free blocks and preemptions. llama.cpp's side is `kv_memory_8k.py`'s: the cache it sizes for one
8k sequence, into the same memory.
Usage: python scripts/kv_concurrency_8k.py --model FILE [--requests 40] [--tokens 8192] [--decode 256]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenloop import SamplingParams
from tokenloop.bench.replay import VirtualClock
from tokenloop.engine import LLMEngine
from tokenloop.llm import build_engine_config
from tokenloop.sim.cost import StepCostModel
from tokenloop.sim.runner import SimulatedRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--decode", type=int, default=256)
    args = parser.parse_args()
    engine = LLMEngine(build_engine_config(args.model, dtype="auto", max_model_len=args.tokens + args.decode + 8))
    core = engine.core
    vocab = core.vocab_size
    total = core.stats().num_free_blocks
    core.runner = SimulatedRunner(StepCostModel(step=1e-3), VirtualClock(), total, core.config.cache.block_size, vocab,
                                  vocab - 1, vocab - 2)
    params = SamplingParams(temperature=0.0, max_tokens=args.decode, ignore_eos=True)
    for i in range(args.requests):  # distinct prompts: no prefix-cache sharing between requests
        engine.add_request(f"r{i}", [1000 + ((i * 131 + j) * 7919) % (vocab - 2000) for j in range(args.tokens)],
                           params)
    most_running = steps = 0
    least_free = total
    decoding_steps: Counter[int] = Counter()  # steps by how many requests were past their prefill
    while engine.has_unfinished_requests():
        engine.step()  # the engine's step, not the core's: its output processor learns which requests finished
        steps += 1
        stats = core.stats()
        running = core.scheduler.running_requests()
        decoding_steps[sum(r.num_computed_tokens >= args.tokens for r in running)] += 1
        most_running = max(most_running, stats.num_running)
        least_free = min(least_free, stats.num_free_blocks)
    most_decoding = max(decoding_steps)
    print(f"{args.model}: pool {total} blocks; {args.requests} requests of {args.tokens} prompt tokens, "
          f"{args.decode} generated each, in {steps} steps")
    print(f"most running at once {most_running}, most decoding at once {most_decoding}, fewest free blocks "
          f"{least_free}, preemptions {core.stats().num_preemptions}")
    print("steps by requests decoding at once (top 5): "
          + ", ".join(f"{n}: {c}" for n, c in sorted(decoding_steps.items(), reverse=True)[:5]))


if __name__ == "__main__":
    main()
