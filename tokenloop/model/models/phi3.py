"""Phi-3 / Phi-4-mini: Llama's layer with Q/K/V and gate/up already fused in the checkpoint, partial rotary
(Phi-4-mini rotates 3/4 of each head) and LongRoPE (layers/rotary.py)."""

from __future__ import annotations

from tokenloop.config import ModelConfig
from tokenloop.model.layers.layer_weights import LayerWeights
from tokenloop.model.models.llama import LlamaModel
from tokenloop.model.weights import WeightSource


class Phi3Model(LlamaModel):
    """Phi-3. The fused CPU kernels rotate whole heads, so a partially rotary model runs the op path
    (`LlamaModel._fusable` checks the rotary dim)."""

    @classmethod
    def tensor_names(cls, config: ModelConfig) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            names += [p + n + ".weight" for n in ("input_layernorm", "post_attention_layernorm",
                                                  "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                  "mlp.down_proj")]
        return names

    @classmethod
    def layer_weights(cls, source: WeightSource, config: ModelConfig, index: int) -> LayerWeights:
        p = f"model.layers.{index}."
        return LayerWeights(
            input_norm=source.take(p + "input_layernorm.weight"),
            qkv=source.fuse([p + "self_attn.qkv_proj.weight"]),
            qkv_bias=None,
            o_proj=source.fuse([p + "self_attn.o_proj.weight"]),
            post_attention_norm=source.take(p + "post_attention_layernorm.weight"),
            gate_up=source.fuse([p + "mlp.gate_up_proj.weight"]),
            down=source.fuse([p + "mlp.down_proj.weight"]),
        )
