"""Gemma 3 (text): Llama's decoder with Gemma's changes.

The embedding is scaled by sqrt(hidden); every norm is Gemma's (1 + w) RMSNorm; a layer has four of them
(before and after attention, before and after the MLP); the MLP is GeGLU (tanh-GELU gate); Q and K heads are
RMS-normalized before rotary; attention scales by `query_pre_attn_scalar` ** -0.5; sliding-window layers, with
their own rotary base, interleave with global ones (`ModelConfig.layer_types`); the LM head is the embedding.
Layers are grouped by attention kind into equal KV groups (`ModelConfig.kv_groups`, docs/kv-groups.md): the
i-th layer of every group shares the i-th K/V tensor pair, each through its own group's block table, and a
sliding group's table holds only the blocks its window covers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from tokenloop.config import KVGroup, ModelConfig, RopeScaling
from tokenloop.model.attention import AttentionMetadata, paged_attention
from tokenloop.model.layers import kv
from tokenloop.model.layers.layer_weights import LayerWeights
from tokenloop.model.layers.linear import linear
from tokenloop.model.layers.mlp import gated_mlp, gelu_tanh
from tokenloop.model.layers.norm import LayerNorms, head_rms_norm_, offset_norm_weight, rms_norm
from tokenloop.model.layers.rotary import (
    RotaryTables,
    apply_rope,
    rope_inverse_frequencies,
)
from tokenloop.model.lora_slots import LoRABatch
from tokenloop.model.models.llama import LlamaModel
from tokenloop.model.weights import WeightSource

_NORMS = ("input_norm", "post_attention_norm", "pre_feedforward_norm", "post_feedforward_norm", "q_norm",
          "k_norm")


@dataclass
class Gemma3LayerWeights(LayerWeights):
    """A Gemma 3 layer: Llama's weights plus the norms around the MLP (`post_attention_norm` here normalizes
    the attention's output, not the MLP's input)."""

    pre_feedforward_norm: torch.Tensor | None = None
    post_feedforward_norm: torch.Tensor | None = None

    def norms(self) -> LayerNorms:
        assert self.pre_feedforward_norm is not None
        return LayerNorms(self.input_norm, self.post_attention_norm, self.pre_feedforward_norm,
                          self.post_feedforward_norm, self.q_norm, self.k_norm)


class Gemma3Model(LlamaModel):
    """Gemma 3's text decoder. On the CPU the fused kernels run its layer (its norms by place, GeGLU, each
    layer's KV group with its rotary table and window); elsewhere `decoder_layers` below runs it op by op."""

    mlp_activation: ClassVar[str] = "gelu_tanh"

    def __init__(self, config: ModelConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.final_norm = offset_norm_weight(self.final_norm)
        self.layers = [dataclasses.replace(layer, **{n: offset_norm_weight(getattr(layer, n))
                                                     for n in _NORMS}) for layer in self.layers]
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.embed_scale = torch.tensor(math.sqrt(config.hidden_size), dtype=self.dtype, device=self.device)
        local_freq = rope_inverse_frequencies(config.rotary_dim, config.rope_local_theta or config.rope_theta,
                                              RopeScaling())
        self.local_rotary = RotaryTables(local_freq, self.rotary.cos.shape[0], self.device, self.dtype)
        self._kv_groups = config.kv_groups()
        # Each layer's (group, K/V pair): the i-th layer of a group uses the group's table and the i-th pair.
        self._kv_places = {layer: (g, i) for g, group in enumerate(self._kv_groups)
                           for i, layer in enumerate(group.layers)}

    def kv_groups(self) -> tuple[KVGroup, ...]:
        return self._kv_groups

    def attention_places(self) -> list[tuple[int, int]]:
        return [self._kv_places[index] for index in range(len(self.layers))]

    def group_rotary(self, group: int) -> RotaryTables:
        return self.local_rotary if self._kv_groups[group].kind == "sliding" else self.rotary

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One K/V pair per layer of a group, [num_blocks, block_size, num_kv_heads, head_dim] each."""
        shape = (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        return kv.allocate_kv_cache(len(self._kv_groups[0].layers), shape, self.kv_dtype, self.device)

    def kv_bytes_per_block(self, block_size: int) -> int:
        cfg = self.config
        layers = len(self._kv_groups[0].layers)  # a block holds one group's layers
        return kv.kv_bytes_per_block(layers, block_size, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype)

    @classmethod
    def tensor_names(cls, config: ModelConfig) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            names += [p + f"{n}_layernorm.weight" for n in ("input", "post_attention", "pre_feedforward",
                                                            "post_feedforward")]
            names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
            names += [p + f"self_attn.{x}_norm.weight" for x in "qk"]
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        return names

    @classmethod
    def gguf_tensor(cls, hf_name: str, array: np.ndarray) -> np.ndarray:
        # llama.cpp's converter stores Gemma's norms as (1 + w); the model takes HF's w.
        return array - np.float32(1.0) if hf_name.endswith("norm.weight") else array

    @classmethod
    def layer_weights(cls, source: WeightSource, config: ModelConfig, index: int) -> LayerWeights:
        p = f"model.layers.{index}."
        norms = {"q_norm": source.take(p + "self_attn.q_norm.weight"),
                 "k_norm": source.take(p + "self_attn.k_norm.weight"),
                 "pre_feedforward_norm": source.take(p + "pre_feedforward_layernorm.weight"),
                 "post_feedforward_norm": source.take(p + "post_feedforward_layernorm.weight")}
        return Gemma3LayerWeights(**{**vars(super().layer_weights(source, config, index)), **norms})

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed.index_select(0, input_ids) * self.embed_scale

    def decoder_layers(self, hidden: torch.Tensor, positions: torch.Tensor,
                       attn: AttentionMetadata | list[AttentionMetadata],
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       lora: LoRABatch | None = None) -> torch.Tensor:
        """`attn`: one layout per KV group (a single one stands for every group of a one-group split). The op
        path runs no adapters (a Gemma 3 model refuses LoRA at load)."""
        if lora is not None:
            raise ValueError("LoRA adapters are not served for Gemma 3 on the op path")
        cfg = self.config
        num_tokens = hidden.shape[0]
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        eps = cfg.rms_norm_eps
        rotary = {False: self.rotary.at(positions), True: self.local_rotary.at(positions)}
        # A single layout only for a one-group split: groups share the K/V pairs, so each needs its own table.
        assert isinstance(attn, list) or len(self._kv_groups) == 1, "one AttentionMetadata per KV group"
        layouts = attn if isinstance(attn, list) else [attn]
        tick = self.progress.tick
        for index, layer in enumerate(self.layers):
            group, pair = self._kv_places[index]
            key_cache, value_cache = kv_caches[pair]
            assert isinstance(layer, Gemma3LayerWeights) and layer.q_norm is not None \
                and layer.k_norm is not None and layer.pre_feedforward_norm is not None \
                and layer.post_feedforward_norm is not None
            sliding = cfg.is_sliding(index)
            cos, sin = rotary[sliding]
            qkv = linear(rms_norm(hidden, layer.input_norm, eps), layer.qkv)
            head_rms_norm_(qkv, layer.q_norm, layer.k_norm, cfg.num_heads, cfg.num_kv_heads, eps)
            qk = qkv[:, :q_size + kv_size].view(num_tokens, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            q, k = apply_rope(qk, cos, sin).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, q_size + kv_size:].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            attended = paged_attention(q, k, v, key_cache, value_cache, layouts[group], self.scale)
            hidden = hidden + rms_norm(linear(attended.view(num_tokens, q_size), layer.o_proj),
                                       layer.post_attention_norm, eps)
            mlp = gated_mlp(rms_norm(hidden, layer.pre_feedforward_norm, eps), layer.gate_up, layer.down,
                            gelu_tanh)
            hidden = hidden + rms_norm(mlp, layer.post_feedforward_norm, eps)
            tick()
        return hidden
