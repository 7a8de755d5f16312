"""The gated MLP: down(act(gate) * up), gate and up fused into one projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenloop.model.layers.linear import Weight, linear


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (HF's `gelu_pytorch_tanh`): Gemma's GeGLU gate."""
    return F.gelu(x, approximate="tanh")


Adapt = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]  # (out, x, projection) -> out + LoRA's


def gated_mlp(x: torch.Tensor, gate_up: Weight, down: Weight,
              activation: Callable[[torch.Tensor], torch.Tensor] = F.silu, adapt: Adapt | None = None,
              ) -> torch.Tensor:
    """Gated MLP, SiLU-gated by default (Llama's SwiGLU; `gelu_tanh` gives GeGLU); `gate_up` stacks gate's
    rows above up's. `adapt` adds a step's LoRA products to each projection's output (model/lora_slots.py)."""
    if adapt is None:
        gate, up = linear(x, gate_up).chunk(2, dim=-1)
        return linear(activation(gate) * up, down)
    gate, up = adapt(linear(x, gate_up), x, "gate_up").chunk(2, dim=-1)
    activated = activation(gate) * up
    return adapt(linear(activated, down), activated, "down")
