"""`dtype="auto"`: the documented choice on CPUs with and without native bf16 (capabilities mocked)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenloop.config import EngineConfig
from tokenloop.engine import LLMEngine
from tokenloop.errors import ConfigError
from tokenloop.llm import build_engine_config
from tokenloop.model.dtypes import CpuFeatures, resolve_dtype

BF16_CPU = CpuFeatures(avx512_bf16=True)
AMX_CPU = CpuFeatures(amx_bf16=True)
PLAIN_CPU = CpuFeatures()


@pytest.mark.parametrize("features", [BF16_CPU, AMX_CPU])
def test_auto_with_native_bf16(features: CpuFeatures) -> None:
    quantized = resolve_dtype("auto", None, "cpu", quantized_checkpoint=True, features=features)
    assert (quantized.activations, quantized.weights) == ("float32", "quantized")
    floats = resolve_dtype("auto", None, "cpu", quantized_checkpoint=False, features=features)
    assert (floats.activations, floats.weights) == ("float32", "bfloat16")


def test_auto_without_native_bf16() -> None:
    """Packed forms for small batches and a float32 copy for large ones (no bf16 GEMM); floats stay fp32."""
    quantized = resolve_dtype("auto", None, "cpu", quantized_checkpoint=True, features=PLAIN_CPU)
    assert (quantized.activations, quantized.weights, quantized.dense_copy) == ("float32", "quantized", "float32")
    assert "without AVX512-BF16 or AMX" in quantized.describe()
    floats = resolve_dtype("auto", None, "cpu", quantized_checkpoint=False, features=PLAIN_CPU)
    assert (floats.activations, floats.weights) == ("float32", "float32")
    assert "neither AVX512-BF16 nor AMX" in floats.describe()
    for features in (BF16_CPU, AMX_CPU):
        assert resolve_dtype("auto", None, "cpu", True, features).dense_copy == "bfloat16"


def test_explicit_dtypes_are_kept() -> None:
    assert resolve_dtype("float32", None, "cpu", True, BF16_CPU).weights == "float32"
    choice = resolve_dtype("bfloat16", None, "cpu", True, BF16_CPU)
    assert (choice.activations, choice.weights) == ("bfloat16", "bfloat16")
    choice = resolve_dtype("auto", "float32", "cpu", True, BF16_CPU)
    assert (choice.activations, choice.weights) == ("float32", "float32")
    assert resolve_dtype("float32", "quantized", "cpu", True, PLAIN_CPU).weights == "quantized"
    # Nothing to pack in a float checkpoint: bf16 is the nearest form.
    assert resolve_dtype("float32", "quantized", "cpu", False, BF16_CPU).weights == "bfloat16"


def test_auto_on_cuda_is_bf16() -> None:
    for quantized in (True, False):
        choice = resolve_dtype("auto", None, "cuda", quantized, PLAIN_CPU)
        assert (choice.activations, choice.weights) == ("bfloat16", "bfloat16")
    assert resolve_dtype("auto", None, "cuda:1", False, PLAIN_CPU).activations == "bfloat16"
    # Explicit choices win; packed int4 has no GPU kernel, so quantized degrades to bf16 there.
    assert resolve_dtype("float32", None, "cuda", False, PLAIN_CPU).activations == "float32"
    assert resolve_dtype("float32", "quantized", "cuda", True, PLAIN_CPU).weights == "bfloat16"


def test_auto_on_another_device_is_fp32() -> None:
    assert resolve_dtype("auto", None, "mps", True, BF16_CPU).weights == "float32"


def test_device_is_validated() -> None:
    assert EngineConfig(device="cuda:0").device == "cuda:0"
    for bad in ("gpu", "cuda:x", "cuda:"):
        with pytest.raises(ConfigError, match="device must be cpu, cuda or cuda:N"):
            EngineConfig(device=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_fails_before_loading(tmp_path: Path) -> None:
    # The model path does not exist: the device error must come first, naming the problem.
    with pytest.raises(ConfigError, match="device 'cuda' was asked for, but torch .* use --device cpu"):
        LLMEngine(build_engine_config(str(tmp_path / "no-model"), device="cuda"))


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 avx512_vnni\n\n"
                    "flags : amx_bf16\n")
    assert CpuFeatures.detect(info) == CpuFeatures(avx512_bf16=True, amx_bf16=False)  # first CPU's line
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    assert not CpuFeatures.detect(info).native_bf16
    assert CpuFeatures.detect(tmp_path / "missing") == PLAIN_CPU


def test_engine_config_accepts_auto_and_quantized() -> None:
    assert EngineConfig().dtype == "auto"
    assert EngineConfig(weight_dtype="quantized").weight_dtype == "quantized"
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(dtype="int4")


@pytest.mark.parametrize("features,weights", [(PLAIN_CPU, torch.float32), (BF16_CPU, torch.bfloat16)])
def test_engine_resolves_auto_for_its_cpu(tiny, monkeypatch: pytest.MonkeyPatch, features: CpuFeatures,
                                          weights: torch.dtype) -> None:  # tiny: a Checkpoint
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls: features))
    engine = LLMEngine(build_engine_config(str(tiny.path)), checkpoint=tiny)
    assert engine.dtype_choice.activations == "float32" and engine.model.dtype == torch.float32
    assert engine.model.layers[0].qkv.dtype == weights
    assert engine.runner.last_weight_form == str(weights).removeprefix("torch.")


def test_kv_cache_auto_is_bf16_under_dtype_auto_on_the_cpu() -> None:
    for features in (BF16_CPU, AMX_CPU, PLAIN_CPU):
        for quantized in (True, False):
            choice = resolve_dtype("auto", None, "cpu", quantized, features)
            assert (choice.activations, choice.kv_cache) == ("float32", "bfloat16")
            assert "KV cache bfloat16" in choice.describe() and "activations float32" in choice.describe()
    assert resolve_dtype("auto", "float32", "cpu", True, BF16_CPU).kv_cache == "bfloat16"
    # An explicit dtype (the HF parity tests pin float32) keeps the activations' dtype; so do other devices.
    explicit = resolve_dtype("float32", None, "cpu", True, BF16_CPU)
    assert explicit.kv_cache == "float32" and explicit.describe().startswith("activations and KV cache float32")
    assert resolve_dtype("bfloat16", None, "cpu", True, BF16_CPU).kv_cache == "bfloat16"
    assert resolve_dtype("auto", None, "cuda", False, PLAIN_CPU).kv_cache == "bfloat16"
    assert resolve_dtype("auto", None, "mps", False, PLAIN_CPU).kv_cache == "float32"


def test_kv_cache_dtype_as_configured() -> None:
    choice = resolve_dtype("float32", None, "cpu", False, PLAIN_CPU, kv_cache_dtype="bfloat16")
    assert (choice.activations, choice.kv_cache) == ("float32", "bfloat16")
    assert "KV cache bfloat16 (as configured)" in choice.describe()
    assert resolve_dtype("auto", None, "cpu", True, BF16_CPU, kv_cache_dtype="float32").kv_cache == "float32"
    assert resolve_dtype("auto", None, "cuda", True, PLAIN_CPU, kv_cache_dtype="bfloat16").kv_cache == "bfloat16"
    with pytest.raises(ConfigError, match="kv_cache_dtype float32 differs from the activations' bfloat16 on cuda"):
        resolve_dtype("auto", None, "cuda", True, PLAIN_CPU, kv_cache_dtype="float32")


def test_kv_cache_dtype_is_validated() -> None:
    assert EngineConfig().kv_cache_dtype == "auto"
    assert build_engine_config("m", kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    for bad in ("float16", "fp8", "bf16"):
        with pytest.raises(ConfigError, match="kv_cache_dtype must be auto, float32, bfloat16, got"):
            EngineConfig(kv_cache_dtype=bad)


def test_kv_cache_dtype_flag_reaches_the_engine_config() -> None:
    import argparse

    from tokenloop.cli.options import _engine_options, add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert _engine_options(parser.parse_args(["--kv-cache-dtype", "bfloat16"]))["kv_cache_dtype"] == "bfloat16"
    assert "kv_cache_dtype" not in _engine_options(parser.parse_args([]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])


@pytest.mark.parametrize("kv_cache_dtype,element", [("float32", 4), ("bfloat16", 2)])
def test_engine_sizes_its_pool_by_the_kv_dtype(tiny, kv_cache_dtype: str, element: int) -> None:  # tiny: a Checkpoint
    """bf16 K/V: twice the blocks in the same memory budget."""
    budget = 1 << 20
    engine = LLMEngine(build_engine_config(str(tiny.path), dtype="float32", kv_cache_dtype=kv_cache_dtype,
                                           kv_cache_memory_bytes=budget), checkpoint=tiny)
    cfg = tiny.config
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * element
    assert engine.model.kv_dtype == getattr(torch, kv_cache_dtype) and engine.model.dtype == torch.float32
    assert engine.model.kv_bytes_per_block(16) == per_block
    assert engine.kv_cache.num_blocks == budget // per_block
    assert engine.runner.kv_caches[0][0].dtype == getattr(torch, kv_cache_dtype)
