"""Checkpoint tensors -> a model's weights: GGUF names per architecture, and `WeightSource`.

Weights travel under HF's names (`model.layers.0.self_attn.q_proj.weight`), whatever the file. A GGUF's names
(`blk.0.attn_q.weight`) are translated with the `gguf` package's own per-architecture maps, which know where
families differ (Gemma's `ffn_norm` is HF's `pre_feedforward_layernorm`, Llama's is `post_attention_layernorm`):
the model class lists the HF names it may take and the map gives each one's GGUF name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import gguf
import torch

from tokenloop.errors import ModelLoadError
from tokenloop.model.ggml_tensor import GGMLTensor, QType
from tokenloop.model.int8_dot import Q8DotWeight
from tokenloop.model.kquant_dot import KQuantDotWeight
from tokenloop.model.layers.linear import Weight
from tokenloop.model.quantized import (
    PackedLinear,
    PackThresholds,
    Q8Weight,
    QuantizedEmbedding,
    dense_weight,
    pack_fused,
    pack_linear,
)

# Tensors with no HF counterpart (llama.cpp's precomputed rotary factors) keep their GGUF base name.
_GGUF_ONLY = (gguf.MODEL_TENSOR.ROPE_FREQS, gguf.MODEL_TENSOR.ROPE_FACTORS_LONG,
              gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)


def gguf_to_hf_names(gguf_arch: str, num_layers: int, hf_names: Iterable[str]) -> dict[str, str]:
    """GGUF tensor name -> HF name, for the HF names a model of architecture `gguf_arch` may take."""
    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == gguf_arch), None)
    if arch is None:
        raise ValueError(f"the gguf package knows no architecture {gguf_arch!r}")
    tensor_map = gguf.get_tensor_name_map(arch, num_layers)
    table: dict[str, str] = {}
    for hf_name in hf_names:
        gguf_name = tensor_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"the gguf package has no {gguf_arch} name for {hf_name!r}")
        table[gguf_name] = hf_name
    for kind in _GGUF_ONLY:
        if kind in gguf.MODEL_TENSORS[arch]:
            table[gguf.TENSOR_NAMES[kind] + ".weight"] = gguf.TENSOR_NAMES[kind]
    return table


@dataclass
class WeightSource:
    """A checkpoint's HF-named tensors, handed out in the forms the model runs: `take` a vector or matrix,
    `fuse` several projections into one matrix (Q/K/V, gate/up), `stack_experts` one per expert, packed for
    the quantized kernels where the checkpoint's blocks allow. One tensor is converted at a time: the whole
    model never exists in float32 unless asked.

    `dtype` is the activations' (norms, biases, embeddings), `matrix_dtype` the projections'. With
    `quantized` (CPU only), `GGMLTensor` projections run packed (int4 / Q8_0) for small batches and in
    `dense_copy_dtype` for large ones."""

    weights: Mapping[str, torch.Tensor | GGMLTensor]
    device: str | torch.device = "cpu"
    dtype: torch.dtype = torch.float32
    matrix_dtype: torch.dtype = torch.float32
    quantized: bool = False
    thresholds: PackThresholds = field(default_factory=PackThresholds)
    dense_copy_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.quantized:  # dense copies for large batches only where the model is small enough to afford them
            self.thresholds = self.thresholds.for_model(self.weights.values(), self.dense_copy_dtype)

    def has(self, name: str) -> bool:
        return name in self.weights

    def raw(self, name: str) -> torch.Tensor | GGMLTensor:
        if name not in self.weights:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        return self.weights[name]

    def take(self, name: str, as_dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor, dense, in `as_dtype` (default: the activations')."""
        return dense_weight(self.raw(name), as_dtype or self.dtype).to(self.device)

    def fuse(self, names: list[str], as_dtype: torch.dtype | None = None) -> Weight:
        """The named matrices stacked by rows into one projection (packed when all are quantized blocks)."""
        return self._join([self.raw(n) for n in names], as_dtype or self.matrix_dtype, self.thresholds)

    def stack_experts(self, names: list[str], count: int) -> list[Weight]:
        """Each of `count` experts' projections `names` (with `{}` for the expert index, e.g.
        `mlp.experts.{}.gate_proj.weight`) fused by rows, one projection per expert. A checkpoint holds them
        one tensor per expert (HF) or stacked in one [count, rows, columns] tensor under the name without the
        index (GGUF's `ffn_*_exps`). Packed experts keep no dense copy: a step reads only the experts its
        tokens chose, so each one's rows are few, and a copy of all of them would double the bytes held."""
        packed_only = dataclasses.replace(self.thresholds, keep_dense=False)
        stacked = [self.weights.get(name.replace(".{}", "")) for name in names]
        return [self._join([self._expert(name, whole, expert, count) for name, whole in zip(names, stacked)],
                           self.matrix_dtype, packed_only) for expert in range(count)]

    def _expert(self, name: str, stacked: torch.Tensor | GGMLTensor | None, expert: int,
                count: int) -> torch.Tensor | GGMLTensor:
        """Expert `expert`'s matrix of projection `name`, from a stacked tensor or its own."""
        if stacked is None:
            return self.raw(name.format(expert))
        if isinstance(stacked, GGMLTensor):
            rows = stacked.shape[0] // count  # a GGMLTensor folds the expert axis into its rows
            return GGMLTensor(stacked.tensor_type, (rows, stacked.shape[1]),
                              stacked.blocks[expert * rows:(expert + 1) * rows])
        if stacked.dim() != 3 or stacked.shape[0] != count:
            raise ModelLoadError(f"stacked experts {name.replace('.{}', '')!r}: [{count}, rows, columns] "
                                 f"expected, got {tuple(stacked.shape)}")
        return stacked[expert]

    def _join(self, parts: list[torch.Tensor | GGMLTensor], as_dtype: torch.dtype,
              thresholds: PackThresholds) -> Weight:
        """Matrices stacked by rows into one projection, packed when all are quantized blocks."""
        blocks = [p for p in parts if isinstance(p, GGMLTensor)]
        if self.quantized and len(blocks) == len(parts):
            fused = pack_fused(blocks, thresholds, self.dense_copy_dtype)
            if fused is not None:
                return fused
        return torch.cat([dense_weight(p, as_dtype).to(self.device) for p in parts], dim=0).contiguous()

    def embedding_and_head(self, embed_name: str, head_name: str, tied: bool,
                           ) -> tuple[torch.Tensor | QuantizedEmbedding, Weight]:
        """The token embedding and the LM head; a tied head reads the embedding's tensor, and where both run
        in the same form one copy serves both."""
        tied = tied or not self.has(head_name)
        head_raw = self.raw(embed_name if tied else head_name)
        lm_head: Weight
        if self.quantized and isinstance(head_raw, GGMLTensor):
            # Logits in fp32: bf16 logits (steps of 1/8 near |20|) cost ~1% of greedy top-1 agreement.
            lm_head = pack_linear(head_raw, self.thresholds, dense_dtype=torch.float32)
        else:
            lm_head = self.take(embed_name if tied else head_name, self.matrix_dtype).contiguous()
        embed_raw = self.raw(embed_name)
        embed: torch.Tensor | QuantizedEmbedding
        fp32 = self.dtype == torch.float32  # the quantized lookup yields fp32 rows
        if fp32 and tied and isinstance(lm_head, PackedLinear) and isinstance(lm_head.packed,
                                                                              (Q8Weight, Q8DotWeight,
                                                                               KQuantDotWeight)):
            embed = QuantizedEmbedding(lm_head.packed)
        elif fp32 and self.quantized and isinstance(embed_raw, GGMLTensor) and embed_raw.tensor_type == QType.Q8_0:
            embed = QuantizedEmbedding(Q8Weight.from_q8(embed_raw))  # rows dequantized at lookup: exact
        else:
            embed = self.take(embed_name).contiguous()
        if tied and self.matrix_dtype == self.dtype and isinstance(embed, torch.Tensor) and not self.quantized:
            lm_head = embed  # one copy serves both
        return embed, lm_head
