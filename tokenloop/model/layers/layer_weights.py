"""One decoder layer's weights in the forms they run: what the families build (models/) and what the fused CPU
forward reads (fused_cpu.py), below both."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokenloop.model.int8_gemm import MLP_PASSES
from tokenloop.model.layers.linear import Weight
from tokenloop.model.layers.norm import LayerNorms
from tokenloop.model.quantized import PackedLinear


@dataclass(frozen=True)
class DecodeExperts:
    """An MoE layer's routed experts as the one-call decode loop runs them (csrc/decode_layers.cpp's
    `LayerExperts`, one csrc/moe_experts.cpp call): `tensors` the router [E, hidden] float32 and the stacked
    gate/up and down packs' codes and scales; `numbers` top k, renormalize (0 or 1), gate/up form, down form."""

    tensors: list[torch.Tensor]
    numbers: list[int]


@dataclass
class LayerWeights:
    """One decoder layer's weights, in the forms they run."""

    input_norm: torch.Tensor
    qkv: Weight  # [(H + 2 KVH) * D, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: Weight
    post_attention_norm: torch.Tensor
    gate_up: Weight | None  # [2 * intermediate, hidden]; None where experts replace the MLP (layers/moe.py)
    down: Weight | None
    q_norm: torch.Tensor | None = None  # [D]: RMSNorm of each Q head before rotary (Qwen3)
    k_norm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # The MLP's many-row calls take one activation code set (model/int8_gemm.py: what that costs in precision).
        if isinstance(self.gate_up, PackedLinear):
            self.gate_up = replace(self.gate_up, gemm_passes=MLP_PASSES)
        if isinstance(self.down, PackedLinear):
            self.down = replace(self.down, gemm_passes=MLP_PASSES)

    def norms(self) -> LayerNorms:
        """The norms by place: `post_attention_norm` is the MLP's input norm in Llama's layer."""
        return LayerNorms(self.input_norm, None, self.post_attention_norm, None, self.q_norm, self.k_norm)

    def decode_experts(self) -> DecodeExperts | None:
        """The routed experts that replace this layer's MLP, as `decode_layers` runs them; None for a gated MLP,
        or experts the loop cannot run (MoE families override it)."""
        return None
