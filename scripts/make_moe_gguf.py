"""Write a random-weight GGUF with OLMoE-1B-7B's shape, for speed measurements (BENCHMARKS.md, "MoE at a real
shape"): 64 experts a layer, 8 active, hidden 2048, 16 layers, each expert's FFN 1024 wide, 16 heads of 128,
vocabulary 50304, untied LM head. A decode step's cost does not depend on the weights' values, only on their
shape and encoding (random routers spread tokens over the experts about evenly, as trained ones roughly do).

    scripts/make_moe_gguf.py OUT.gguf [--type Q8_0|F16] [--layers N]

Matrices are F16 or Q8_0 (norms and routers F32, as llama.cpp's converter and llama-quantize leave them); an
F16 file is what llama.cpp's `llama-quantize` takes to make a Q4_K_M one. Rows come from a pool of random rows
(std fan_in^-0.5), quantized once and drawn at random for each tensor, so writing the 7B file takes minutes,
not the hour that quantizing 7B values with the gguf package's numpy code would. Tensors are written one at a
time: memory stays at a pool and one stacked-expert tensor. The tokenizer is a byte-level BPE over the 256
byte symbols and their pairs (enough merges to fill the vocabulary), with a ChatML template.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.quants import quantize

ARCH = "olmoe"
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
POOL_ROWS = 4096


@dataclass(frozen=True)
class Shape:
    """OLMoE-1B-7B's (allenai/OLMoE-1B-7B-0924 config.json)."""

    layers: int = 16
    hidden: int = 2048
    heads: int = 16
    experts: int = 64
    experts_used: int = 8
    expert_ffn: int = 1024
    vocab: int = 50304
    context: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5


def byte_level_vocab(size: int) -> tuple[list[str], list[str]]:
    """Tokens and merges of a byte-level BPE (GPT-2's byte-to-symbol map): the 256 byte symbols, then pairs
    of them, with the special tokens last."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    shifted = [b for b in range(256) if b not in printable]
    symbols = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(shifted))]
    pairs = size - len(symbols) - len(SPECIALS)
    merges = [f"{symbols[i // 256]} {symbols[i % 256]}" for i in range(pairs)]
    return symbols + [m.replace(" ", "") for m in merges] + list(SPECIALS), merges


def row_pool(columns: int, tensor_type: QType, rng: np.random.Generator) -> np.ndarray:
    """POOL_ROWS random rows of `columns` values (std columns^-0.5) in `tensor_type`'s bytes or values."""
    rows = rng.standard_normal((POOL_ROWS, columns), dtype=np.float32) * np.float32(columns ** -0.5)
    return rows.astype(np.float16) if tensor_type == QType.F16 else quantize(rows, tensor_type)


def write(out: Path, tensor_type: QType, shape: Shape, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), arch=ARCH)
    writer.add_name("random OLMoE-1B-7B shape")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.expert_ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.experts_used)
    file_type = gguf.LlamaFileType.MOSTLY_Q8_0 if tensor_type == QType.Q8_0 else gguf.LlamaFileType.MOSTLY_F16
    writer.add_file_type(file_type)
    tokens, merges = byte_level_vocab(shape.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    pools = {width: row_pool(width, tensor_type, rng) for width in (shape.hidden, shape.expert_ffn)}
    h, ffn, experts = shape.hidden, shape.expert_ffn, shape.experts
    # (name, leading dims, columns, quantized): the order llama.cpp's converter writes them in.
    plan: list[tuple[str, tuple[int, ...], int, bool]] = [("token_embd.weight", (shape.vocab,), h, True)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (), h, False), (b + "ffn_norm.weight", (), h, False),
                 (b + "attn_q_norm.weight", (), h, False), (b + "attn_k_norm.weight", (), h, False)]
        plan += [(b + f"attn_{x}.weight", (h,), h, True) for x in ("q", "k", "v", "output")]
        plan += [(b + "ffn_gate_inp.weight", (experts,), h, False),
                 (b + "ffn_gate_exps.weight", (experts, ffn), h, True),
                 (b + "ffn_up_exps.weight", (experts, ffn), h, True),
                 (b + "ffn_down_exps.weight", (experts, h), ffn, True)]
    plan += [("output_norm.weight", (), h, False), ("output.weight", (shape.vocab,), h, True)]

    def data(lead: tuple[int, ...], columns: int, quantized: bool) -> np.ndarray:
        if not lead:  # a norm
            return np.ones(columns, dtype=np.float32)
        if not quantized:  # a router: F32
            return rng.standard_normal((*lead, columns), dtype=np.float32) * np.float32(columns ** -0.5)
        pool = pools[columns]
        return pool[rng.integers(0, POOL_ROWS, size=int(np.prod(lead)))].reshape(*lead, pool.shape[-1])

    for name, lead, columns, quantized in plan:
        if quantized:  # Q8_0: the rows' bytes (uint8); F16: values
            pool = pools[columns]
            dims, dtype = (*lead, pool.shape[-1]), pool.dtype
        else:
            dims, dtype = (*lead, columns), np.dtype(np.float32)
        raw = tensor_type if quantized and tensor_type != QType.F16 else None
        writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize, raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _name, lead, columns, quantized in plan:
        writer.write_tensor_data(data(lead, columns, quantized))
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", choices=("Q8_0", "F16"), default="Q8_0")
    parser.add_argument("--layers", type=int, default=Shape.layers, help="fewer layers for a quick run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    write(args.out, QType[args.type], Shape(layers=args.layers), args.seed)
    size = args.out.stat().st_size
    elapsed = time.perf_counter() - start
    print(f"{args.out}: {size / 1e9:.2f} GB, {args.layers} layers, {args.type}, {elapsed:.0f} s")


if __name__ == "__main__":
    main()
