"""OLMoE: Qwen3-MoE's layer with QK-norm over the whole Q and K projections (one RMSNorm across all heads,
not per head), and the router's top-k softmax weights used as they are (`norm_topk_prob` false)."""

from __future__ import annotations

import torch

from tokenloop.model.layers.layer_weights import LayerWeights
from tokenloop.model.layers.norm import rms_norm
from tokenloop.model.models.qwen3_moe import Qwen3MoeModel


class OlmoeModel(Qwen3MoeModel):
    """OLMoE-1B-7B and its kin."""

    def normalize_qk(self, layer: LayerWeights, qkv: torch.Tensor) -> None:
        assert layer.q_norm is not None and layer.k_norm is not None
        q_size, kv_size = layer.q_norm.shape[0], layer.k_norm.shape[0]
        q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
        eps = self.config.rms_norm_eps
        q.copy_(rms_norm(q, layer.q_norm.to(qkv.dtype), eps))
        k.copy_(rms_norm(k, layer.k_norm.to(qkv.dtype), eps))
