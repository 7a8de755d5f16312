"""Where a mixture-of-experts decode step's time goes, by part: the MoE blocks (router, grouping, the experts'
kernels with the bytes they read and the GB/s that makes, the rest of the block) and everything else
(attention, norms, embedding, head, sampling: the step's wall time less the MoE blocks'):

    PYTHONPATH=. python scripts/profile_moe_decode.py MODEL.gguf [--batches 1 8] [--tokens 32]

The parts are timed with perf_counter around the block's functions (each wrapper adds ~1 us a call), over the
decode steps of `--tokens` greedy tokens a stream after a warm-up; the native MoE call, where it runs, counts
as one "experts (native)" part. Per decode token = per step / batch.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from tokenloop import LLM, SamplingParams
from tokenloop.model.layers import mlp as mlp_layer
from tokenloop.model.layers import moe as moe_layer
from tokenloop.model.models import qwen3_moe


class PartTimer:
    """Seconds and calls per part, and the weight bytes the expert kernels read."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.expert_bytes = 0
        self.active = False

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return function(*args, **kwargs)
            start = time.perf_counter()
            out = function(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1
            return out
        return timed

    def wrap_linear(self, function: Callable[..., Any]) -> Callable[..., Any]:
        timed = self.wrap("experts' kernels", function)

        def counted(x: torch.Tensor, weight: Any, *args: Any) -> Any:
            if self.active:
                self.expert_bytes += moe_layer._weight_bytes(weight)
            return timed(x, weight, *args)
        return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=1024)
    timer = PartTimer()
    moe_layer.route = timer.wrap("router", moe_layer.route)
    moe_layer.group_by_expert = timer.wrap("grouping", moe_layer.group_by_expert)
    mlp_layer.linear = timer.wrap_linear(mlp_layer.linear)
    moe_layer.gated_mlp = timer.wrap("experts (gated MLP)", moe_layer.gated_mlp)
    qwen3_moe.moe_block = timer.wrap("MoE blocks", qwen3_moe.moe_block)
    print(f"{torch.get_num_threads()} threads; experts {llm.engine.model.weight_form(1)}")
    for batch in args.batches:
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 5000 + 10 for j in range(32)]} for i in range(batch)]
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate(prompts, warm, use_tqdm=False)
        # The prompts' prefill runs unmeasured: its step is one generate of one token.
        full = SamplingParams(temperature=0.0, max_tokens=args.tokens + 1, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        prefill = time.perf_counter() - start
        timer.seconds.clear()
        timer.calls.clear()
        timer.expert_bytes = 0
        timer.active = True
        start = time.perf_counter()
        llm.generate(prompts, full, use_tqdm=False)
        wall = time.perf_counter() - start - prefill  # the decode steps, less one prefill step's estimate
        timer.active = False
        steps = args.tokens
        per_step = {name: 1e3 * s / steps for name, s in timer.seconds.items()}
        moe = per_step.get("MoE blocks", 0.0)
        inner = sum(v for k, v in per_step.items() if k not in ("MoE blocks", "experts (gated MLP)"))
        experts = per_step.get("experts (gated MLP)", 0.0)
        kernels = per_step.get("experts' kernels", 0.0)
        rows = [("decode step (wall)", 1e3 * wall / steps),
                ("  outside the MoE blocks (attention, norms, head, sampling)", 1e3 * wall / steps - moe),
                ("  MoE blocks", moe),
                ("    router (linear, softmax, top-k)", per_step.get("router", 0.0)),
                ("    grouping (argsort, bincount)", per_step.get("grouping", 0.0)),
                ("    experts' kernels (gate_up, down)", kernels),
                ("    experts' other ops (SiLU, mul, casts)", experts - kernels),
                ("    block glue (gather, cat, unsort, weighted sum)", moe - inner + kernels - experts
                 if experts else moe - inner)]
        calls = timer.calls.get("experts' kernels", 0)
        gbps = timer.expert_bytes / max(timer.seconds.get("experts' kernels", 0.0), 1e-9) / 1e9
        print(f"batch {batch}: {steps} decode steps, {batch * steps / wall:.1f} tok/s; expert kernels read "
              f"{timer.expert_bytes / steps / 1e6:.1f} MB a step at {gbps:.1f} GB/s "
              f"({calls // steps} calls a step)")
        print("| part | ms a step | share |\n|---|---:|---:|")
        for name, ms in rows:
            print(f"| {name} | {ms:.2f} | {100 * ms / rows[0][1]:.0f}% |")


if __name__ == "__main__":
    main()
