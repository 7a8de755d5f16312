"""The gated MLP: down(act(gate) * up), gate and up fused into one projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenloop.model.layers.linear import Weight, linear


def gated_mlp(x: torch.Tensor, gate_up: Weight, down: Weight) -> torch.Tensor:
    """SiLU-gated MLP (Llama's SwiGLU); `gate_up` stacks gate's rows above up's."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down)
