"""Where a mixture-of-experts decode step's time goes, by part: the model's forward (the MoE blocks with
their router, grouping and experts' kernels, the bytes those read and the GB/s that makes; the LM head; the
rest: the attention half, norms and glue) and the step outside the forward (scheduling, sampling, update):

    PYTHONPATH=. python scripts/profile_moe_decode.py MODEL.gguf [--batches 1 8] [--tokens 32] [--rounds 2]
        [--paths loop fused ops ops-moe]

The parts are timed with perf_counter around the functions (each wrapper adds ~1 us a call), over the decode
steps of `--tokens` greedy tokens a stream after a warm-up (only calls over one row a stream: the prefill step
is left out). The paths, alternated round after round in one process so that all see the same machine:
`loop` every layer of a decode step in one C++ call (`decode_layers`, the MoE block inside it: not timed
apart), `fused` the fused kernels layer by layer with the native MoE call, `ops` the per-layer op path with the
native MoE call (main before branch moe3), `ops-moe` the op path with the MoE block in ops too.
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

    def wrap_step(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """A call over a decode step's rows (the forward's token ids, the head's hidden rows) is timed."""
        def timed(rows: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if rows.shape[0] != self.decode_rows:
                return function(rows, *args, **kwargs)
            start = time.perf_counter()
            out = function(rows, *args, **kwargs)
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


PATHS = {"loop": "one C++ call a step", "fused": "fused kernels a layer", "ops": "per-layer ops, native MoE",
         "ops-moe": "per-layer ops, MoE in ops"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=["loop", "fused", "ops"],
                        help="the decode step's paths, alternated in each round")
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
    print(f"{torch.get_num_threads()} threads; experts {model.weight_form(1)}; outside the experts a step reads "
          f"{other_weight_bytes(model) / 1e6:.0f} MB of weights (attention projections, routers, LM head)")
    model.lm_head = timer.wrap_step("LM head", model.lm_head)
    model.forward = timer.wrap_step("model forward", model.forward)
    layers: list[Any] = list(model.layers)  # an MoE family's MoELayerWeights
    natives = {id(layer): layer.moe.native for layer in layers}
    fused_ops, fused_decode = model.fused_ops, model.fused_decode
    for batch in args.batches:
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 5000 + 10 for j in range(32)]} for i in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        for round_ in range(args.rounds):
            for path in args.paths:
                for layer in layers:  # "ops-moe": the layers' MoE blocks take the op path
                    layer.moe.native = None if path == "ops-moe" else natives[id(layer)]
                model.fused_ops = fused_ops if path in ("loop", "fused") else None
                model.fused_decode = fused_decode and path == "loop"
                print(f"batch {batch}, {path} path, round {round_ + 1}: " + profile_decode(llm, timer, prompts,
                                                                                            args.tokens))


def other_weight_bytes(model: Any) -> int:
    """The bytes of the weights every decode step reads besides the experts: attention projections, routers
    and the LM head (the embedding reads one row a token)."""
    layers = sum(moe_layer._weight_bytes(w) for layer in model.layers for w in (layer.qkv, layer.o_proj))
    routers = sum(moe_layer._weight_bytes(layer.moe.router) for layer in model.layers)
    return layers + routers + moe_layer._weight_bytes(model.lm_head.weight)


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
    forward, head = per_step.get("model forward", 0.0), per_step.get("LM head", 0.0)
    moe = per_step.get("MoE blocks", 0.0)
    inner = sum(per_step.get(k, 0.0) for k in ("native call", "router", "grouping", "experts' kernels"))
    experts = per_step.get("experts (gated MLP)", 0.0)
    kernels = per_step.get("experts' kernels", 0.0)
    rows = [("decode step (wall)", 1e3 * wall / tokens),
            ("  outside the model's forward (schedule, sample, update)", 1e3 * wall / tokens - forward),
            ("  LM head", head),
            ("  layers outside the MoE blocks (attention half, norms, glue)", forward - head - moe),
            ("  MoE blocks (in the one call: not timed apart)" if not moe else "  MoE blocks", moe),
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
