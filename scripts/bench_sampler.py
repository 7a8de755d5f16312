"""Sampler time per step at batch 256, against the sampler of another git revision, side by side.

Three batches on the default model's vocabulary size: all greedy; mixed temperature / top-p / top-k
(half the rows seeded); and the mixed batch with repetition / frequency / presence penalties. Each
request carries `--output` output tokens, so work that grows with output length shows. The old
sampler is loaded from `git show REV:tokenloop/sampler.py`; both must give the same tokens.

Usage: python scripts/bench_sampler.py [--against HEAD] [--batch 256] [--output 512] [--repeat 20]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenloop.request import Request, SamplingParams
from tokenloop.sampler import Sampler

VOCAB = 49152


def load_sampler_at(rev: str, directory: str) -> Any:
    source = subprocess.run(["git", "show", f"{rev}:tokenloop/sampler.py"], check=True, capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parents[1]).stdout
    path = Path(directory) / "old_sampler.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_sampler", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["old_sampler"] = module  # dataclasses look their module up while being created
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.Sampler


def make_requests(kind: str, batch: int, output: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(batch):
        if kind == "greedy":
            params = SamplingParams(temperature=0.0)
        else:
            params = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9, 0.5]),
                                    top_k=rng.choice([0, 0, 50]), seed=i if i % 2 else None)
            if kind == "penalties":
                params.repetition_penalty, params.frequency_penalty, params.presence_penalty = 1.1, 0.3, 0.2
        request = Request(f"r{i}", [rng.randrange(VOCAB) for _ in range(32)], params, arrival_ns=0)
        for _ in range(output):
            request.append_output_token(rng.randrange(VOCAB))
        requests.append(request)
    return requests


def time_sampler(sampler_cls: Any, kind: str, args: argparse.Namespace, logits: torch.Tensor,
                 ) -> tuple[float, list[list[int]]]:
    requests = make_requests(kind, args.batch, args.output, args.seed)
    sampler = sampler_cls(VOCAB, seed=0)
    times, tokens = [], []
    for _ in range(args.repeat):
        begin = time.perf_counter()
        out = sampler.sample(logits, requests)
        times.append(time.perf_counter() - begin)
        tokens.append(out.token_ids)
    return 1e3 * statistics.median(times), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", default="HEAD")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--output", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logits = torch.randn(args.batch, VOCAB, generator=torch.Generator().manual_seed(args.seed)) * 3
    with tempfile.TemporaryDirectory() as tmp:
        old_cls = load_sampler_at(args.against, tmp)
        print(f"batch {args.batch}, vocab {VOCAB}, {args.output} output tokens per request, median of "
              f"{args.repeat} calls, {torch.get_num_threads()} threads")
        print(f"| batch | sampler at {args.against} ms | this sampler ms | same tokens |")
        print("| --- | ---: | ---: | --- |")
        for kind in ("greedy", "mixed", "penalties"):
            old_ms, old_tokens = time_sampler(old_cls, kind, args, logits)
            new_ms, new_tokens = time_sampler(Sampler, kind, args, logits)
            print(f"| {kind} | {old_ms:.2f} | {new_ms:.2f} | {old_tokens == new_tokens} |", flush=True)


if __name__ == "__main__":
    main()
