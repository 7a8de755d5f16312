"""Checkpoint tensors -> a model's weights: GGUF names per architecture.

Weights travel under HF's names (`model.layers.0.self_attn.q_proj.weight`), whatever the file. A GGUF's names
(`blk.0.attn_q.weight`) are translated with the `gguf` package's own per-architecture maps, which know where
families differ (Gemma's `ffn_norm` is HF's `pre_feedforward_layernorm`, Llama's is `post_attention_layernorm`):
the model class lists the HF names it may take and the map gives each one's GGUF name.
"""

from __future__ import annotations

from collections.abc import Iterable

import gguf

# Tensors with no HF counterpart (llama.cpp's precomputed rotary factors) keep their GGUF base name.
_GGUF_ONLY = (gguf.MODEL_TENSOR.ROPE_FREQS, gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)


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

