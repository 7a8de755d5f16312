"""Qwen3: Llama's layer with each Q and K head RMS-normalized before rotary, and no QKV bias."""

from __future__ import annotations

import dataclasses

from tokenloop.config import ModelConfig
from tokenloop.model.layers.layer_weights import LayerWeights
from tokenloop.model.models.llama import LlamaModel
from tokenloop.model.weights import WeightSource


class Qwen3Model(LlamaModel):
    """Qwen3 (dense): the fused kernels run its QK-norm (`LayerWeights.norms` names the Q and K heads' norms)."""

    @classmethod
    def tensor_names(cls, config: ModelConfig) -> list[str]:
        return super().tensor_names(config) + [f"model.layers.{i}.self_attn.{x}_norm.weight"
                                               for i in range(config.num_layers) for x in "qk"]

    @classmethod
    def layer_weights(cls, source: WeightSource, config: ModelConfig, index: int) -> LayerWeights:
        p = f"model.layers.{index}.self_attn."
        layer = super().layer_weights(source, config, index)
        return dataclasses.replace(layer, q_norm=source.take(p + "q_norm.weight"),
                                   k_norm=source.take(p + "k_norm.weight"))
