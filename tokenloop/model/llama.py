"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

One forward takes a flat batch mixing prefill chunks and decode tokens of different requests and
returns logits only for the tokens that will be sampled. Weights are held as plain tensors or, for a
quantized GGUF, as packed int4 / Q8_0 forms (`model/quantized.py`), Q/K/V and gate/up fused into one
matrix each, so a layer is a handful of large GEMMs and little Python.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from tokenloop.config import ModelConfig, RopeScaling
from tokenloop.core.heartbeat import Progress
from tokenloop.errors import ModelLoadError
from tokenloop.model.attention import AttentionMetadata, paged_attention, triton_attention_kernels
from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.int8_dot import Int4DotWeight, Q8DotWeight
from tokenloop.model.quantized import (GGMLTensor, Int4Weight, PackedLinear, PackThresholds, Q8Weight, QType,
                                       QuantizedEmbedding, dense_linear, dense_weight, pack_linear, prepack_dense)

Weight = torch.Tensor | PackedLinear  # a projection matrix in whichever form it runs


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling, freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim / 2], with default, linear or llama3 scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors
        return (inv_freq / freq_factors.to(torch.float64)).float()
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        original = scaling.original_max_position_embeddings
        low_wavelen = original / scaling.low_freq_factor
        high_wavelen = original / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq, scaled)
    return inv_freq.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate half-split pairs (HF's rotate_half convention). x [T, heads, D]; cos/sin [T, 1, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias). Weights stored narrower than the activations (bf16 or packed weights, fp32
    activations) are multiplied in the weights' dtype and the result widened back."""
    if isinstance(weight, PackedLinear):
        out = weight(x)
        return out if bias is None else out + bias
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    out = F.linear(x.to(weight.dtype), weight).to(x.dtype)
    return out if bias is None else out + bias


def project(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x @ weight.T in the weight form's own output dtype (no widening cast): for the fused CPU path,
    whose elementwise kernels read bf16 or fp32 alike."""
    if isinstance(weight, PackedLinear):
        out = weight.native(x)
    else:
        out = F.linear(x.to(weight.dtype), weight)
    return out if out.is_contiguous() else out.contiguous()


def input_dtype(weight: Weight, rows: int) -> torch.dtype:
    """The activations' dtype `project` multiplies in for a call of `rows` rows."""
    return weight.input_dtype_for(rows) if isinstance(weight, PackedLinear) else weight.dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), fused into one kernel (bit-identical to the unfused form here)."""
    return F.rms_norm(x, weight.shape, weight, eps)


class LMHead:
    """The vocabulary projection. On CPU in fp32 it runs on oneDNN-prepacked weights (`prepack_dense`): the
    49k-row head is the single largest GEMM of a decode step."""

    def __init__(self, weight: Weight) -> None:
        self.weight = weight
        self._packed: torch.Tensor | None = None
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32:
            packed = prepack_dense(weight)
            self._packed = packed if packed.is_mkldnn else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            return linear(hidden, self.weight)
        return dense_linear(hidden, self._packed)


def zeroed_cpu_pool(num_elements: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU tensor of zeros in anonymous memory: the kernel maps in a zeroed page the first time one is
    written, so the pool costs nothing at startup (torch.zeros writes every page: 0.9-2.5 s for 1 GiB on
    this VM, where first-touched memory is slow) and its pages become resident as blocks are first used.
    The tensor keeps the mapping alive."""
    if num_elements == 0:
        return torch.zeros(0, dtype=dtype)
    element_size = torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, num_elements * element_size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                            dtype=dtype, count=num_elements)


@dataclass(frozen=True)
class DecodePlan:
    """The flat argument lists the C++ `decode_layers` takes, for the weight forms of one row count: per layer
    the two norm weights, and per projection its matrix (a pack's codes, or a dense matrix) and the pack's
    scales (torch's int4: bf16 scales and zeros; int8-dot: fp16; an empty tensor for a dense matrix)."""

    norms: list[torch.Tensor]
    matrices: list[torch.Tensor]
    scales: list[torch.Tensor]


_NO_SCALES = torch.empty(0)  # marks a dense matrix in DecodePlan.scales


def decode_projection(weight: Weight, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(matrix, scales) of the form `weight` runs for `rows` rows, when `decode_layers` can run it the way
    `project` does; None otherwise (an fp32-kernel Q8_0 pack, a padded pack, an fp16 matrix). Dense matrices may
    be oneDNN-prepacked (`prepack_dense`)."""
    if isinstance(weight, PackedLinear):
        if weight.dense is None or rows <= weight.packed_max_rows:
            return _unpadded_pack(weight.packed)
        weight = weight.dense
    return (weight, _NO_SCALES) if weight.dtype in (torch.float32, torch.bfloat16) else None


def _unpadded_pack(pack: Int4Weight | Q8Weight | Int4DotWeight | Q8DotWeight) -> tuple[torch.Tensor,
                                                                                    torch.Tensor] | None:
    """A pack's (codes, scales) for `decode_layers`, which sizes outputs from the codes: unpadded packs only."""
    if isinstance(pack, Int4Weight):
        exact = pack.packed.shape[0] == pack.out_features and pack.packed.shape[1] * 2 == pack.in_features
        return (pack.packed, pack.scales_zeros) if exact else None
    if isinstance(pack, (Int4DotWeight, Q8DotWeight)):
        tiles, blocks, _ = pack.codes.shape
        exact = tiles * 16 == pack.out_features and blocks * 32 == pack.in_features
        return (pack.codes, pack.scales) if exact else None
    return None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight  # [(H + 2 KVH) * D, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: Weight
    post_attention_norm: torch.Tensor
    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight


class LlamaModel:
    """A Llama-family decoder. Build it with `from_weights`, run it with `forward`."""

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
        positions = torch.arange(max_positions, dtype=torch.float32, device=self.device)
        angles = torch.outer(positions, inv_freq.to(self.device))
        self.rope_cos = angles.cos().to(self.dtype)
        self.rope_sin = angles.sin().to(self.dtype)
        # The fused elementwise kernels (csrc/fused_layer_ops.cpp) replace ~150 small ops a layer with ~10;
        # they read fp32 or bf16 GEMM outputs, so layers with an fp16 matrix or a QKV bias keep the op path.
        self.fused_ops = self.decode_kernel if self.decode_kernel is not None and self._fusable() else None
        # A pure decode step runs all layers in one C++ call (csrc/decode_layers.cpp), planned per row count.
        self.fused_decode = self.fused_ops is not None and hasattr(self.fused_ops, "decode_layers")
        self._decode_plans: dict[int, DecodePlan | None] = {}
        # Ticked after every layer: a long prefill shows progress to the core's heartbeat (a hang does not).
        # The fused decode path runs its layers in one native call and ticks with the loop's turn instead.
        self.progress = Progress()

    def _fusable(self) -> bool:
        forms = (torch.float32, torch.bfloat16)
        return hasattr(self.decode_kernel, "add_rms_norm") and self.config.head_dim % 2 == 0 and all(
            layer.qkv_bias is None and all(isinstance(w, PackedLinear) or w.dtype in forms
                                           for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
            for layer in self.layers)

    def decode_plan(self, rows: int) -> DecodePlan | None:
        """The `decode_layers` arguments for a pure decode step of `rows` sequences, or None where some
        projection's form for that many rows is one the C++ loop does not run."""
        if rows not in self._decode_plans:
            norms, matrices, scales = [], [], []
            for layer in self.layers:
                norms += [layer.input_norm, layer.post_attention_norm]
                for weight in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                    form = decode_projection(weight, rows)
                    if form is None:
                        self._decode_plans[rows] = None
                        return None
                    matrices.append(form[0])
                    scales.append(form[1])
            self._decode_plans[rows] = DecodePlan(norms, matrices, scales)
        return self._decode_plans[rows]

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

        `dtype` is the activations' and (unless `kv_dtype` says otherwise) the KV cache's; `weight_dtype` (default: the same) is the
        projection matrices' (e.g. bf16 weights halve the bytes a decode step streams, while the
        residual stream, norms, attention and KV cache stay in `dtype`). With `quantized` (CPU only),
        `GGMLTensor` projections run packed (int4 / Q8_0) for small batches and in `dense_copy_dtype` (bf16 where
        the CPU has native bf16 dot products, else fp32) for large ones.
        Weights are converted one tensor at a time: the whole model never exists in float32 unless asked.
        """
        matrix_dtype = weight_dtype or dtype

        def raw(name: str) -> torch.Tensor | GGMLTensor:
            if name not in weights:
                raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
            return weights[name]

        def take(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
            return dense_weight(raw(name), as_dtype).to(device)

        def fuse(names: list[str], as_dtype: torch.dtype = matrix_dtype) -> Weight:
            parts = [raw(n) for n in names]
            if quantized and all(isinstance(p, GGMLTensor) for p in parts):
                joined = GGMLTensor.concat(parts)  # type: ignore[arg-type]
                if joined is not None:
                    return pack_linear(joined, thresholds, dense_dtype=dense_copy_dtype)
            return torch.cat([take(n, as_dtype) for n in names], dim=0).contiguous()

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
            bias = None
            if config.attention_bias:
                bias = fuse([p + f"self_attn.{x}_proj.bias" for x in "qkv"], dtype)
            layers.append(LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=fuse(attn),
                qkv_bias=bias,
                o_proj=fuse([p + "self_attn.o_proj.weight"]),
                post_attention_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=fuse([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=fuse([p + "mlp.down_proj.weight"]),
            ))
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        head_raw = raw(head_name)
        lm_head: Weight
        if quantized and isinstance(head_raw, GGMLTensor):
            # Logits in fp32: bf16 logits (steps of 1/8 near |20|) cost ~1% of greedy top-1 agreement.
            lm_head = pack_linear(head_raw, thresholds, dense_dtype=torch.float32)
        else:
            lm_head = take(head_name, matrix_dtype).contiguous()
        embed_raw = raw("model.embed_tokens.weight")
        embed: torch.Tensor | QuantizedEmbedding
        fp32 = dtype == torch.float32  # the quantized lookup yields fp32 rows
        if fp32 and tied and isinstance(lm_head, PackedLinear) and isinstance(lm_head.packed, (Q8Weight, Q8DotWeight)):
            embed = QuantizedEmbedding(lm_head.packed)
        elif fp32 and quantized and isinstance(embed_raw, GGMLTensor) and embed_raw.tensor_type == QType.Q8_0:
            embed = QuantizedEmbedding(Q8Weight.from_q8(embed_raw))  # rows dequantized at lookup: exact
        else:
            embed = take("model.embed_tokens.weight").contiguous()
        if tied and matrix_dtype == dtype and isinstance(embed, torch.Tensor) and not quantized:
            lm_head = embed  # one copy serves both
        inv_freq = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling,
                                            weights.get("rope_freqs"))
        positions = max_positions or config.max_position_embeddings
        return cls(config, embed, layers, take("model.norm.weight"), lm_head, inv_freq, positions, use_cpu_kernels,
                   kv_dtype)

    def weight_form(self, rows: int) -> str:
        """The form the layers' projections run in for a step of `rows` tokens (int4, q8_0, bfloat16, ...)."""
        gate_up = self.layers[0].gate_up if self.layers else None
        if isinstance(gate_up, PackedLinear):
            return gate_up.form_for(rows)
        return str(gate_up.dtype).removeprefix("torch.") if gate_up is not None else str(self.dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, K and V of shape [num_blocks, block_size, num_kv_heads, head_dim], zeroed (a path that
        gathers whole blocks reads slots not yet written; masked, they must still be finite)."""
        shape = (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        if self.device.type != "cpu":
            return [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                     torch.zeros(shape, dtype=self.kv_dtype, device=self.device)) for _ in self.layers]
        pool = zeroed_cpu_pool(2 * len(self.layers) * math.prod(shape), self.kv_dtype)
        caches = pool.view(len(self.layers), 2, *shape)
        return [(caches[i, 0], caches[i, 1]) for i in range(len(self.layers))]

    def kv_bytes_per_block(self, block_size: int) -> int:
        element = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * self.config.num_layers * block_size * self.config.num_kv_heads * self.config.head_dim * element

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> logits [N, vocab] for the N tokens in `logits_indices` (all if None)."""
        cfg = self.config
        num_tokens = input_ids.shape[0]
        self.last_weight_form = self.weight_form(num_tokens)
        if self.fused_ops is not None:
            return self._forward_fused(input_ids, positions, attn, kv_caches, logits_indices)
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        num_qk_heads = cfg.num_heads + cfg.num_kv_heads
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)

        hidden = self.embed.index_select(0, input_ids)
        tick = self.progress.tick
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches):
            normed = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            qkv = linear(normed, layer.qkv, layer.qkv_bias)
            # Q and K heads are adjacent in the fused output: rotate them in one go.
            qk = apply_rope(qkv[:, :q_size + kv_size].view(num_tokens, num_qk_heads, cfg.head_dim), cos, sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, q_size + kv_size:].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            attended = paged_attention(q, k, v, key_cache, value_cache, attn, self.scale)
            hidden = hidden + linear(attended.view(num_tokens, q_size), layer.o_proj)

            normed = rms_norm(hidden, layer.post_attention_norm, cfg.rms_norm_eps)
            gate, up = linear(normed, layer.gate_up).chunk(2, dim=-1)
            hidden = hidden + linear(F.silu(gate) * up, layer.down)
            tick()

        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        return self.lm_head(rms_norm(hidden, self.final_norm, cfg.rms_norm_eps))

    def _forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """`forward` on the CPU with the fused kernels: the same layer, with each residual add folded into
        the next RMSNorm, the norms written in the next GEMM's input dtype, and rotary + KV write in one."""
        cfg, ops = self.config, self.fused_ops
        assert ops is not None
        num_tokens = input_ids.shape[0]
        positions = positions.contiguous()
        hidden = self.embed.index_select(0, input_ids).contiguous()  # the fp32 residual stream, updated in place
        decode = attn.decode
        plan = None
        if self.fused_decode and decode is not None and decode.kernel is not None \
                and decode.token_index.shape[0] == num_tokens:
            plan = self.decode_plan(num_tokens)
        if plan is not None:  # a pure decode step: the same sequence of kernels, with no Python between layers
            assert decode is not None
            final = torch.empty(num_tokens, cfg.hidden_size)
            ops.decode_layers(hidden, plan.norms, plan.matrices, plan.scales,
                              [cache for pair in kv_caches for cache in pair], positions, self.rope_cos,
                              self.rope_sin, attn.slot_mapping, decode.block_table, decode.seq_lens, cfg.num_heads,
                              cfg.num_kv_heads, cfg.head_dim, self.scale, cfg.rms_norm_eps, self.final_norm, final)
            if logits_indices is not None:
                final = final.index_select(0, logits_indices)
            return self.lm_head(final)
        delta = torch.empty(0)  # the previous layer's MLP output, added inside the next norm
        q = torch.empty(num_tokens, cfg.num_heads, cfg.head_dim)
        k = torch.empty(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = torch.empty_like(k)
        eps = cfg.rms_norm_eps
        tick = self.progress.tick
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches):
            normed = torch.empty(num_tokens, cfg.hidden_size, dtype=input_dtype(layer.qkv, num_tokens))
            ops.add_rms_norm(hidden, delta, layer.input_norm, eps, normed)
            ops.rope_write_kv(project(normed, layer.qkv), positions, self.rope_cos, self.rope_sin, attn.slot_mapping,
                              key_cache, value_cache, q, k, v)
            attended = paged_attention(q, k, v, key_cache, value_cache, attn, self.scale, kv_written=True)
            normed = torch.empty(num_tokens, cfg.hidden_size, dtype=input_dtype(layer.gate_up, num_tokens))
            ops.add_rms_norm(hidden, project(attended.view(num_tokens, -1), layer.o_proj), layer.post_attention_norm,
                             eps, normed)
            gate_up = project(normed, layer.gate_up)
            activated = torch.empty(num_tokens, gate_up.shape[1] // 2, dtype=input_dtype(layer.down, num_tokens))
            ops.silu_mul(gate_up, activated)
            delta = project(activated, layer.down)
            tick()
        final = torch.empty(num_tokens, cfg.hidden_size)
        ops.add_rms_norm(hidden, delta, self.final_norm, eps, final)
        if logits_indices is not None:
            final = final.index_select(0, logits_indices)
        return self.lm_head(final)
