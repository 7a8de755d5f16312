"""Where a mixture-of-experts decode step's time goes, by part: the MoE blocks (router, grouping, the experts'
kernels with the bytes they read and the GB/s that makes, the rest of the block) and everything else
(attention, norms, embedding, head, sampling: the step's wall time less the MoE blocks'):

    PYTHONPATH=. python scripts/profile_moe_decode.py MODEL.gguf [--batches 1 8] [--tokens 32] [--rounds 2]

The parts are timed with perf_counter around the block's functions (each wrapper adds ~1 us a call), over the
decode steps of `--tokens` greedy tokens a stream after a warm-up (the MoE parts only in blocks of one row a
stream: the prefill step is left out); the native MoE call, where it runs, is one part (router, experts, sum).
`--paths native ops` alternates the native call and the op path (`grouped_moe_block`) in one process, round
after round, so that both see the same machine.
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
        self.decode_rows = 0  # the MoE blocks of this many rows are measured (a decode step's)

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

    def wrap_block(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """The MoE block: its parts are measured while it runs on a decode step's rows."""
        timed = self.wrap("MoE blocks", function)

        def block(x: torch.Tensor, *args: Any) -> Any:
            self.active = x.shape[0] == self.decode_rows
            try:
                return timed(x, *args)
            finally:
                self.active = False
        return block

    def wrap_native(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """The native call: the bytes of the experts its routing chose count as its kernels' reads."""
        timed = self.wrap("native call", function)

        def native(x: torch.Tensor, weights: moe_layer.MoEWeights, *args: Any) -> Any:
            out = timed(x, weights, *args)
            if self.active:
                self.expert_bytes += sum(weights.expert_bytes(e) for e in out[1].experts.unique().tolist())
                self.calls["experts' kernels"] += 1
            return out
        return native

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
    parser.add_argument("--paths", nargs="+", choices=["native", "ops"], default=["native", "ops"],
                        help="the MoE block's paths, alternated in each round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=1024)
    timer = PartTimer()
    moe_layer.route = timer.wrap("router", moe_layer.route)
    moe_layer.group_by_expert = timer.wrap("grouping", moe_layer.group_by_expert)
    mlp_layer.linear = timer.wrap_linear(mlp_layer.linear)
    moe_layer.gated_mlp = timer.wrap("experts (gated MLP)", moe_layer.gated_mlp)
    moe_layer.native_moe_block = timer.wrap_native(moe_layer.native_moe_block)
    qwen3_moe.moe_block = timer.wrap_block(qwen3_moe.moe_block)
    model: Any = llm.engine.model
    print(f"{torch.get_num_threads()} threads; experts {model.weight_form(1)}")
    layers: list[Any] = list(model.layers)  # an MoE family's MoELayerWeights
    natives = {id(layer): layer.moe.native for layer in layers}
    for batch in args.batches:
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 5000 + 10 for j in range(32)]} for i in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        for round_ in range(args.rounds):
            for path in args.paths:
                for layer in layers:  # "ops": the layers' MoE blocks take the op path
                    layer.moe.native = natives[id(layer)] if path == "native" else None
                print(f"batch {batch}, {path} path, round {round_ + 1}: " + profile_decode(llm, timer, prompts,
                                                                                            args.tokens))


def profile_decode(llm: LLM, timer: PartTimer, prompts: list[Any], tokens: int) -> str:
    """One measured generate of `tokens` decode steps: a summary line and the table of parts."""
    # The prompts' prefill is taken out: its time is estimated by a generate of one token.
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    prefill = time.perf_counter() - start
    timer.seconds.clear()
    timer.calls.clear()
    timer.expert_bytes = 0
    timer.decode_rows = len(prompts)
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - start - prefill
    timer.decode_rows = 0
    per_step = {name: 1e3 * s / tokens for name, s in timer.seconds.items()}
    moe = per_step.get("MoE blocks", 0.0)
    inner = sum(v for k, v in per_step.items() if k not in ("MoE blocks", "experts (gated MLP)"))
    experts = per_step.get("experts (gated MLP)", 0.0)
    kernels = per_step.get("experts' kernels", 0.0)
    rows = [("decode step (wall)", 1e3 * wall / tokens),
            ("  outside the MoE blocks (attention, norms, head, sampling)", 1e3 * wall / tokens - moe),
            ("  MoE blocks", moe),
            ("    native call (router, experts, weighted sum)", per_step.get("native call", 0.0)),
            ("    router (linear, softmax, top-k)", per_step.get("router", 0.0)),
            ("    grouping (argsort, bincount)", per_step.get("grouping", 0.0)),
            ("    experts' kernels (gate_up, down)", kernels),
            ("    experts' other ops (SiLU, mul, casts)", experts - kernels),
            ("    block glue (gather, cat, unsort, weighted sum, casts)",
             moe - inner + kernels - experts if experts else moe - inner)]
    calls = timer.calls.get("experts' kernels", 0)
    kernel_seconds = timer.seconds.get("experts' kernels", 0.0) or timer.seconds.get("native call", 0.0)
    gbps = timer.expert_bytes / max(kernel_seconds, 1e-9) / 1e9
    lines = [f"{len(prompts) * tokens / wall:.1f} tok/s; expert kernels read {timer.expert_bytes / tokens / 1e6:.1f} "
             f"MB a step at {gbps:.1f} GB/s ({calls // tokens} calls a step)", "| part | ms a step | share |",
             "|---|---:|---:|"]
    lines += [f"| {name} | {ms:.2f} | {100 * ms / rows[0][1]:.0f}% |" for name, ms in rows]
    return "\n".join(lines)

if __name__ == "__main__":
    main()
