"""RMSNorm over the hidden size, and per head (Qwen3's QK-norm)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, fused into one kernel (bit-identical to
    the unfused form here). Over [T, heads, head_dim] with a [head_dim] weight it is the per-head QK-norm."""
    return F.rms_norm(x, weight.shape, weight, eps)


def head_rms_norm_(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, num_heads: int,
                   num_kv_heads: int, eps: float) -> None:
    """Normalize each Q and K head of a fused [T, (H + 2 KVH) * D] projection in place, before rotary."""
    head_dim = q_norm.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    tokens = qkv.shape[0]
    q = qkv[:, :q_size].view(tokens, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(tokens, num_kv_heads, head_dim)
    q.copy_(rms_norm(q, q_norm.to(qkv.dtype), eps))
    k.copy_(rms_norm(k, k_norm.to(qkv.dtype), eps))


def offset_norm_weight(weight: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm scales by (1 + w): the 1 folded into the weight once, so `rms_norm` runs it (in fp32
    the same numbers as adding it at every call)."""
    return weight + 1.0


@dataclass(frozen=True)
class LayerNorms:
    """A decoder layer's norm weights by place, None where the layer has none: what the fused CPU kernels take
    (Llama: input and feed-forward input; Qwen3 adds the Q and K heads'; Gemma 3 also normalizes the attention's
    and the MLP's outputs before each residual add)."""

    input: torch.Tensor
    attention_output: torch.Tensor | None
    feed_forward_input: torch.Tensor
    feed_forward_output: torch.Tensor | None
    q_heads: torch.Tensor | None
    k_heads: torch.Tensor | None

    def in_order(self, absent: torch.Tensor) -> list[torch.Tensor]:
        """The six in the kernels' order, `absent` (an empty tensor) standing for each missing one."""
        return [absent if w is None else w for w in (self.input, self.attention_output, self.feed_forward_input,
                                                     self.feed_forward_output, self.q_heads, self.k_heads)]
