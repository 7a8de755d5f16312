"""Simulator speed: N requests of a ShareGPT-shaped synthetic trace through the simulated engine.

One policy (default fcfs) on a profile, the real scheduler, KV cache and sampler; prints the wall time, the
steps, and the simulated span. The issue's goal is 100,000 requests in <= 60 s on this machine.

Usage: python scripts/bench_sim.py [--requests 100000] [--rate 100] [--policy fcfs] [--profile h100-llama3-8b]

Torch runs on one thread here (`--torch-threads`): the simulator's tensors (a step's one-hot logits) are
small, and on a loaded 2-core machine a parallel op waits for a core per worker thread: 10 ms an op were
seen at 256 sampling rows, 5x the whole step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from tokenloop.bench.trace import TraceConfig, make_trace
from tokenloop.cli.simulate_runs import simulate_trace
from tokenloop.sim.profiles import load_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=100.0, help="arrivals per second (Poisson)")
    parser.add_argument("--profile", default="h100-llama3-8b")
    parser.add_argument("--policy", default="fcfs", help="fcfs, priority, sjf or fair")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    trace = make_trace(TraceConfig(num_requests=args.requests, seed=0, request_rate=args.rate))
    profile = load_profile(args.profile)
    began, began_cpu = time.perf_counter(), time.process_time()
    options = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    result, _ = simulate_trace(trace, profile, [args.policy], options)
    wall, cpu = time.perf_counter() - began, time.process_time() - began_cpu
    run = result.runs[0]
    tokens = sum(r.output_len for r in run.records)
    print(f"{args.requests} requests at {args.rate:g}/s, {args.policy}, on {profile.name}: "
          f"wall {wall:.2f} s, cpu {cpu:.2f} s "
          f"({wall / args.requests * 1e3:.3f} ms/request, {wall / run.num_steps * 1e6:.0f} us/step, "
          f"{wall / tokens * 1e6:.1f} us/output token); {run.num_steps} steps, {tokens} output tokens, "
          f"simulated span {run.duration_s:.1f} s, {run.num_preemptions} preemptions")


if __name__ == "__main__":
    main()
