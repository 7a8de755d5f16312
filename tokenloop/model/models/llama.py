"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache; the parent of the
other families.

One forward takes a flat batch mixing prefill chunks and decode tokens of different requests and returns
logits only for the tokens that will be sampled. Weights are held as plain tensors or, for a quantized GGUF,
as packed int4 / Q8_0 forms (`model/quantized.py`), Q/K/V and gate/up fused into one matrix each, so a layer
is a handful of large GEMMs and little Python. A subclass overrides the class methods that say which tensors a
checkpoint holds and how a layer's weights are built, and the capabilities below.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import ClassVar, Protocol

import numpy as np
import torch

from tokenloop.config import KVGroup, ModelConfig
from tokenloop.model import fused_cpu
from tokenloop.model.attention import AttentionMetadata, paged_attention, triton_attention_kernels
from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.layers import kv
from tokenloop.model.layers.layer_weights import LayerWeights
from tokenloop.model.layers.linear import LMHead, Weight, linear
from tokenloop.model.layers.mlp import Adapt, gated_mlp
from tokenloop.model.layers.norm import head_rms_norm_, rms_norm
from tokenloop.model.layers.rotary import RotaryTables, apply_rope, longrope_frequencies, rope_inverse_frequencies
from tokenloop.model.lora_slots import LoRABatch
from tokenloop.model.quantized import PackedLinear, PackThresholds, QuantizedEmbedding
from tokenloop.model.weights import WeightSource


class LayerTicker(Protocol):
    """What the model ticks after each layer: the engine core's progress counter (tokenloop.core.heartbeat);
    the one-call decode loop ticks its `layer_ticks` tensor instead (None: nothing counts)."""

    @property
    def layer_ticks(self) -> torch.Tensor | None: ...

    def tick(self) -> None: ...


class _Uncounted:
    """A model's ticker until an engine core hands it its own: the ticks go nowhere."""

    __slots__ = ()
    layer_ticks = None

    def tick(self) -> None:
        pass


class LlamaModel:
    """A Llama-family decoder. Build it with `from_weights`, run it with `forward`."""

    # Capabilities (model/fused_cpu.py): whether this family's layer runs on the fused CPU kernels, and
    # whether a pure decode step may run all its layers in the one C++ call. The kernels know the layers whose
    # norms `LayerWeights.norms` names, with the MLP gate `mlp_activation` ("silu" or "gelu_tanh").
    fused_layer_ops: ClassVar[bool] = True
    fused_decode_loop: ClassVar[bool] = True
    mlp_activation: ClassVar[str] = "silu"

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor | QuantizedEmbedding,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: Weight,
        inv_freq: torch.Tensor,
        max_positions: int,
        use_cpu_kernels: bool = True,
        kv_dtype: torch.dtype | None = None,
        rope_magnitude: float = 1.0,
    ) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = LMHead(lm_head)
        self.device = final_norm.device
        self.dtype = final_norm.dtype  # activations
        self.kv_dtype = kv_dtype or self.dtype  # the KV cache's elements (bf16 K/V are widened as attention reads)
        self.last_weight_form = self.weight_form(1)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        # Kernels that read K/V in place: C++ for decode on the CPU in float32 (fp32 or bf16 K/V), Triton on CUDA
        # for decode and prefill; elsewhere (or with use_kernels off) the gather + SDPA reference does the work.
        self.decode_kernel: ModuleType | None = None
        self.prefill_kernel: ModuleType | None = None
        if use_cpu_kernels and self.device.type == "cpu" and self.dtype == torch.float32 \
                and self.kv_dtype in (torch.float32, torch.bfloat16):
            self.decode_kernel = paged_decode_kernels()
        elif use_cpu_kernels and self.device.type == "cuda":
            self.decode_kernel = self.prefill_kernel = triton_attention_kernels()
        self.rotary = RotaryTables(inv_freq, max_positions, self.device, self.dtype, rope_magnitude)
        # The fused elementwise kernels (csrc/fused_layer_ops.cpp) replace ~150 small ops a layer with ~10;
        # they read fp32 or bf16 GEMM outputs, so layers with an fp16 matrix or a QKV bias keep the op path.
        self.fused_ops = self.decode_kernel if self.decode_kernel is not None and self._fusable() else None
        # A pure decode step runs all layers in one C++ call (csrc/decode_layers.cpp), planned per row count.
        self.fused_decode = self.fused_ops is not None and self.fused_decode_loop \
            and hasattr(self.fused_ops, "decode_layers")
        self._decode_plans: dict[int, fused_cpu.DecodePlan | None] = {}
        # Ticked after every layer: a long prefill shows progress to the core's heartbeat (a hang does not).
        # The fused decode path runs its layers in one native call and ticks with the loop's turn instead.
        self.progress: LayerTicker = _Uncounted()  # the engine core hands over its heartbeat's counter

    @property
    def rope_cos(self) -> torch.Tensor:
        return self.rotary.cos

    @property
    def rope_sin(self) -> torch.Tensor:
        return self.rotary.sin

    def _fusable(self) -> bool:
        return self.fused_layer_ops and hasattr(self.decode_kernel, "add_rms_norm") \
            and self.rotary.rotary_dim == self.config.head_dim and fused_cpu.layers_fusable(self.layers)

    def decode_plan(self, rows: int) -> fused_cpu.DecodePlan | None:
        """The `decode_layers` arguments for a pure decode step of `rows` sequences, or None where some
        projection's form for that many rows is one the C++ loop does not run."""
        if rows not in self._decode_plans:
            self._decode_plans[rows] = fused_cpu.plan_decode(self.layers, rows)
        return self._decode_plans[rows]

    @classmethod
    def tensor_names(cls, config: ModelConfig) -> list[str]:
        """Every HF-named tensor a checkpoint of this family may hold (the optional ones too)."""
        names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                      p + "self_attn.o_proj.weight"]
            names += [p + f"self_attn.{x}_proj.{kind}" for x in "qkv" for kind in ("weight", "bias")]
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        return names

    @classmethod
    def gguf_tensor(cls, hf_name: str, array: np.ndarray) -> np.ndarray:
        """A GGUF's dense tensor as HF's checkpoint holds it (where a family's converter changed it)."""
        return array

    @classmethod
    def layer_weights(cls, source: WeightSource, config: ModelConfig, index: int) -> LayerWeights:
        """Layer `index`'s weights from the checkpoint."""
        p = f"model.layers.{index}."
        bias = None
        if config.attention_bias:
            bias = source.fuse([p + f"self_attn.{x}_proj.bias" for x in "qkv"], source.dtype)
        gate_up, down = cls.mlp_weights(source, config, index)
        return LayerWeights(
            input_norm=source.take(p + "input_layernorm.weight"),
            qkv=source.fuse([p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
            qkv_bias=bias,
            o_proj=source.fuse([p + "self_attn.o_proj.weight"]),
            post_attention_norm=source.take(p + "post_attention_layernorm.weight"),
            gate_up=gate_up,
            down=down,
        )

    @classmethod
    def mlp_weights(cls, source: WeightSource, config: ModelConfig, index: int) -> tuple[Weight | None,
                                                                                         Weight | None]:
        """Layer `index`'s MLP: gate/up fused, and down (None, None where a family's experts replace it)."""
        p = f"model.layers.{index}.mlp."
        gate_up = source.fuse([p + "gate_proj.weight", p + "up_proj.weight"])
        return gate_up, source.fuse([p + "down_proj.weight"])

    @classmethod
    def rotary_frequencies(cls, source: WeightSource, config: ModelConfig, context: int) -> tuple[torch.Tensor,
                                                                                                  float]:
        """The rotary inverse frequencies [rotary_dim / 2] for a context of `context` positions, and the
        magnitude cos and sin are scaled by."""
        if config.rope_scaling.rope_type == "longrope":
            return longrope_frequencies(config.rotary_dim, config.rope_theta, config.rope_scaling, context,
                                        config.max_position_embeddings)
        factors = source.weights.get("rope_freqs")
        return rope_inverse_frequencies(config.rotary_dim, config.rope_theta, config.rope_scaling,
                                        factors if isinstance(factors, torch.Tensor) else None), 1.0

    @classmethod
    def from_weights(
        cls,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_positions: int | None = None,
        use_cpu_kernels: bool = True,
        weight_dtype: torch.dtype | None = None,
        quantized: bool = False,
        thresholds: PackThresholds = PackThresholds(),
        kv_dtype: torch.dtype | None = None,
        dense_copy_dtype: torch.dtype = torch.bfloat16,
    ) -> LlamaModel:
        """Build from HF-named weights (`model.layers.0.self_attn.q_proj.weight`, ...).

        `dtype` is the activations' and (unless `kv_dtype` says otherwise) the KV cache's; `weight_dtype`
        (default: the same) is the projection matrices' (e.g. bf16 weights halve the bytes a decode step
        streams, while the residual stream, norms, attention and KV cache stay in `dtype`). With `quantized`
        (CPU only), `GGMLTensor` projections run packed (int4 / Q8_0) for small batches and in
        `dense_copy_dtype` (bf16 where the CPU has native bf16 dot products, else fp32) for large ones.
        """
        source = WeightSource(weights, device, dtype, weight_dtype or dtype, quantized, thresholds, dense_copy_dtype)
        layers = [cls.layer_weights(source, config, i) for i in range(config.num_layers)]
        embed, lm_head = source.embedding_and_head("model.embed_tokens.weight", "lm_head.weight",
                                                   config.tie_word_embeddings)
        context = max_positions or config.max_position_embeddings
        inv_freq, magnitude = cls.rotary_frequencies(source, config, context)
        return cls(config, embed, layers, source.take("model.norm.weight"), lm_head, inv_freq, context,
                   use_cpu_kernels, kv_dtype, magnitude)

    def weight_form(self, rows: int) -> str:
        """The form the layers' projections run in for a step of `rows` tokens (int4, q8_0, bfloat16, ...)."""
        gate_up = self.layers[0].gate_up if self.layers else None
        if isinstance(gate_up, PackedLinear):
            return gate_up.form_for(rows)
        return str(gate_up.dtype).removeprefix("torch.") if gate_up is not None else str(self.dtype)

    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The layers by KV group (docs/kv-groups.md): one full group here; a family with sliding layers
        that releases what their window has passed states its own (Gemma 3)."""
        return (KVGroup("full", 0, tuple(range(len(self.layers)))),)

    def attention_places(self) -> list[tuple[int, int]]:
        """Per layer, its KV group (the index of its `AttentionMetadata`) and its K/V pair in the cache list."""
        return [(0, index) for index in range(len(self.layers))]

    def group_rotary(self, group: int) -> RotaryTables:
        """The rotary tables of KV group `group`'s layers."""
        return self.rotary

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, K and V of shape [num_blocks, block_size, num_kv_heads, head_dim], zeroed."""
        shape = (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        return kv.allocate_kv_cache(len(self.layers), shape, self.kv_dtype, self.device)

    def kv_bytes_per_block(self, block_size: int) -> int:
        cfg = self.config
        return kv.kv_bytes_per_block(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | list[AttentionMetadata],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> logits [N, vocab] for the N tokens in `logits_indices` (all if None).
        `attn` is the step's layout, or one per KV group for a model with several (`kv_groups`); `lora`: the
        step's adapter products, added on top of the projections (model/lora_slots.py)."""
        cfg = self.config
        num_tokens = input_ids.shape[0]
        self.last_weight_form = self.weight_form(num_tokens)
        if self.fused_ops is not None:
            return fused_cpu.forward_fused(self, input_ids, positions, attn, kv_caches, logits_indices, lora)
        hidden = self.embed_tokens(input_ids)
        hidden = self.decoder_layers(hidden, positions, attn, kv_caches, *(() if lora is None else (lora,)))
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        return self.lm_head(rms_norm(hidden, self.final_norm, cfg.rms_norm_eps))

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: each token's embedding row [T, hidden]."""
        return self.embed.index_select(0, input_ids)

    def decoder_layers(self, hidden: torch.Tensor, positions: torch.Tensor,
                       attn: AttentionMetadata | list[AttentionMetadata],
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       lora: LoRABatch | None = None) -> torch.Tensor:
        """The residual stream [T, hidden] through every layer (the op path), before the final norm."""
        assert isinstance(attn, AttentionMetadata), "a one-group model gets one layout"
        cfg = self.config
        num_tokens = hidden.shape[0]
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        num_qk_heads = cfg.num_heads + cfg.num_kv_heads
        cos, sin = self.rotary.at(positions)
        tick = self.progress.tick
        for index, (layer, (key_cache, value_cache)) in enumerate(zip(self.layers, kv_caches)):
            adapt = None if lora is None else lora.for_layer(index)
            normed = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            qkv = linear(normed, layer.qkv, layer.qkv_bias)
            if adapt is not None:
                adapt(qkv, normed, "qkv")
            self.normalize_qk(layer, qkv)
            # Q and K heads are adjacent in the fused output: rotate them in one go.
            qk = apply_rope(qkv[:, :q_size + kv_size].view(num_tokens, num_qk_heads, cfg.head_dim), cos, sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, q_size + kv_size:].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            attended = paged_attention(q, k, v, key_cache, value_cache, attn, self.scale)
            attended = attended.view(num_tokens, q_size)
            attention_out = linear(attended, layer.o_proj)
            hidden = hidden + (attention_out if adapt is None else adapt(attention_out, attended, "o_proj"))
            hidden = hidden + self.feed_forward(layer, rms_norm(hidden, layer.post_attention_norm,
                                                                cfg.rms_norm_eps), adapt)
            tick()
        return hidden

    def normalize_qk(self, layer: LayerWeights, qkv: torch.Tensor) -> None:
        """Normalize Q and K of a fused [T, (H + 2 KVH) * D] projection in place, where the layer has QK-norm
        weights: per head (Qwen3), before rotary."""
        if layer.q_norm is not None and layer.k_norm is not None:
            cfg = self.config
            head_rms_norm_(qkv, layer.q_norm, layer.k_norm, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps)

    def feed_forward(self, layer: LayerWeights, normed: torch.Tensor, adapt: Adapt | None = None) -> torch.Tensor:
        """The layer's MLP over the normalized residual stream [T, hidden]; `adapt` adds LoRA's products."""
        assert layer.gate_up is not None and layer.down is not None
        return gated_mlp(normed, layer.gate_up, layer.down, adapt=adapt)
