"""The gated MLP: down(act(gate) * up), gate and up fused into one projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenloop.model.layers.linear import Weight, linear


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (HF's `gelu_pytorch_tanh`): Gemma's GeGLU gate."""
    return F.gelu(x, approximate="tanh")


def gated_mlp(x: torch.Tensor, gate_up: Weight, down: Weight,
              activation: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """Gated MLP, SiLU-gated by default (Llama's SwiGLU; `gelu_tanh` gives GeGLU); `gate_up` stacks gate's
    rows above up's."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(activation(gate) * up, down)
