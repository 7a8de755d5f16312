"""The mixture-of-experts block (OLMoE, Qwen3-MoE): a router picks each token's top-k experts, and the block's
output is their gated MLPs' sum, weighted by the router's softmax (renormalized over the chosen k or not).

A step's (token, expert) pairs are sorted by expert, so each active expert runs one matmul pair over all the
tokens routed to it, and an expert no token chose is never read: with packed quantized experts a batch-1
decode step streams only its k experts' bytes of every layer (k / num_experts of the expert weights).

Experts packed for the int8-dot kernels run the whole block in one native call (csrc/moe_experts.cpp: routing,
every active expert's projections and the weighted sum in one parallel region); `grouped_moe_block`, the same
block in PyTorch ops over the packs' own matmuls, is its fallback and reference twin.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.fused_cpu import ProjectionForm, ProjectionPart, decode_projection
from tokenloop.model.layers.layer_weights import DecodeExperts
from tokenloop.model.layers.linear import Weight, linear
from tokenloop.model.layers.mlp import gated_mlp
from tokenloop.model.quantized import PackedLinear

_NATIVE_FORMS = (ProjectionForm.INT4_DOT, ProjectionForm.Q8_DOT, ProjectionForm.Q5_K, ProjectionForm.Q6_K,
                 ProjectionForm.Q4_K)


@dataclass(frozen=True)
class StackedExperts:
    """One projection of every expert as the native call reads it: codes [E, tiles, K / 32, bytes] and fp16
    scales [E, ...] of one int8-dot pack form (the experts' own packs are views into them: no second copy)."""

    codes: torch.Tensor
    scales: torch.Tensor
    form: ProjectionForm

    @classmethod
    def of(cls, projections: list[Weight]) -> StackedExperts | None:
        """The experts' packs stacked, each pack re-pointed at its slice; None unless `_native_parts` finds them."""
        parts = _native_parts(projections)
        if parts is None:
            return None
        stacked = cls(torch.stack([p.matrix for p in parts]), torch.stack([p.scales for p in parts]), parts[0].form)
        for expert, weight in enumerate(projections):
            assert isinstance(weight, PackedLinear)
            pack = weight.packed
            pack.codes, pack.scales = stacked.codes[expert], stacked.scales[expert]  # type: ignore[union-attr]
        return stacked


def _native_parts(projections: list[Weight]) -> list[ProjectionPart] | None:
    """Each expert's pack as the kernels call it, when every expert holds one int8-dot pack (no dense copy)
    of the same form and shape; else None."""
    parts = []
    for weight in projections:
        if not isinstance(weight, PackedLinear) or weight.dense is not None:
            return None
        found = decode_projection(weight, 1)
        if found is None or len(found) != 1 or found[0].form not in _NATIVE_FORMS:
            return None
        parts.append(found[0])
    first = parts[0] if parts else None
    if first is None or any(p.form != first.form or p.matrix.shape != first.matrix.shape
                            or p.scales.shape != first.scales.shape or p.width != first.width for p in parts):
        return None
    return parts


@dataclass
class MoEWeights:
    """One layer's experts: the router [num_experts, hidden] (dense) and each expert's gate/up (gate's rows
    above up's) and down projections, in whichever form they run."""

    router: torch.Tensor
    gate_up: list[Weight]
    down: list[Weight]
    top_k: int
    normalize: bool  # renormalize the top-k weights to sum to 1 (Qwen3-MoE), or keep the softmax's (OLMoE)
    native: tuple[StackedExperts, StackedExperts] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if _native_parts(self.gate_up) is not None and _native_parts(self.down) is not None:
            gate_up, down = StackedExperts.of(self.gate_up), StackedExperts.of(self.down)
            assert gate_up is not None and down is not None
            self.native = (gate_up, down)
            self.router = self.router.float().contiguous()  # the kernel's router; the op path's softmax is fp32

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def decode_experts(self) -> DecodeExperts | None:
        """The block as the one-call decode loop runs it (the native call's arguments), where it runs natively."""
        if self.native is None:
            return None
        gate_up, down = self.native
        return DecodeExperts([self.router, gate_up.codes, gate_up.scales, down.codes, down.scales],
                             [self.top_k, int(self.normalize), int(gate_up.form), int(down.form)])

    def expert_bytes(self, expert: int) -> int:
        """The bytes expert `expert`'s two projections hold."""
        return sum(_weight_bytes(w) for w in (self.gate_up[expert], self.down[expert]))


@dataclass(frozen=True)
class Routing:
    """Each token's chosen experts [T, k] (int64) and their weights [T, k] (the activations' dtype)."""

    experts: torch.Tensor
    weights: torch.Tensor


@dataclass(frozen=True)
class ExpertGroups:
    """A step's (token, expert) pairs sorted by expert: `tokens` [T * k] is each pair's token, `slots` [T * k]
    its position in the flattened [T, k] routing, and `counts` how many pairs each expert has (a Python list:
    the split sizes)."""

    tokens: torch.Tensor
    slots: torch.Tensor
    counts: list[int]


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    """The router's softmax over experts (in float32), its top k, renormalized to sum 1 if `normalize`."""
    probs = torch.softmax(linear(x, router).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights.to(x.dtype))


def group_by_expert(experts: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sort the flattened routing [T, k] by expert id (stable: tokens keep their order within an expert)."""
    flat = experts.reshape(-1)
    slots = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return ExpertGroups(slots // experts.shape[1], slots, counts)


def moe_block(x: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
    """x [T, hidden] -> the routed experts' weighted sum [T, hidden]: in one native call where the experts are
    int8-dot packs and the kernels are built, else `grouped_moe_block`."""
    kernel = paged_decode_kernels() if weights.native is not None and x.device.type == "cpu" else None
    if kernel is None or not hasattr(kernel, "moe_experts"):
        return grouped_moe_block(x, weights)
    return native_moe_block(x, weights, kernel)[0]


def native_moe_block(x: torch.Tensor, weights: MoEWeights, kernel: object) -> tuple[torch.Tensor, Routing]:
    """The block in csrc/moe_experts.cpp: (output [T, hidden] in x's dtype, the routing it chose)."""
    assert weights.native is not None
    gate_up, down = weights.native
    x32 = x.float().contiguous()
    out = torch.empty_like(x32)
    experts = torch.empty(x.shape[0], weights.top_k, dtype=torch.int64)
    chosen = torch.empty(x.shape[0], weights.top_k, dtype=torch.float32)
    kernel.moe_experts(x32, weights.router, weights.top_k, weights.normalize,  # type: ignore[attr-defined]
                       gate_up.codes, gate_up.scales, int(gate_up.form), down.codes, down.scales, int(down.form),
                       out, experts, chosen)
    return out.to(x.dtype), Routing(experts, chosen.to(x.dtype))


def grouped_moe_block(x: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
    """The block in PyTorch ops: tokens grouped by expert, each active expert's gated MLP over its rows."""
    routing = route(x, weights.router, weights.top_k, weights.normalize)
    groups = group_by_expert(routing.experts, weights.num_experts)
    gathered = x.index_select(0, groups.tokens)
    outputs = []
    start = 0
    for expert, count in enumerate(groups.counts):
        if count == 0:
            continue  # no token chose it: its weights stay unread
        rows = gathered[start:start + count]
        outputs.append(gated_mlp(rows, weights.gate_up[expert], weights.down[expert]))
        start += count
    # Back to [T, k] order and summed over k, in the same order whatever the batch (an index_add_ here ran
    # 150 ms for one decode token: torch's deterministic mode turns it into a serial scatter).
    by_slot = (torch.cat(outputs) if outputs else gathered).index_select(0, torch.argsort(groups.slots))
    tokens, k = routing.weights.shape
    return (by_slot.view(tokens, k, x.shape[1]) * routing.weights.unsqueeze(-1)).sum(dim=1)


def active_expert_bytes(x: torch.Tensor, weights: MoEWeights) -> tuple[int, int]:
    """(bytes of the experts a step over `x` reads, bytes of all experts): what routing saves."""
    experts = route(x, weights.router, weights.top_k, weights.normalize).experts.unique().tolist()
    total = sum(weights.expert_bytes(e) for e in range(weights.num_experts))
    return sum(weights.expert_bytes(e) for e in experts), total


def _weight_bytes(weight: Weight) -> int:
    if isinstance(weight, PackedLinear):
        dense = 0 if weight.dense is None else weight.dense.numel() * weight.dense.element_size()
        return weight.packed.nbytes + dense
    return weight.numel() * weight.element_size()

