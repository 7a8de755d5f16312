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


@pytest.mark.parametrize("quantized", [True, False])
def test_auto_without_native_bf16_is_fp32(quantized: bool) -> None:
    choice = resolve_dtype("auto", None, "cpu", quantized_checkpoint=quantized, features=PLAIN_CPU)
    assert (choice.activations, choice.weights) == ("float32", "float32")
    assert "neither AVX512-BF16 nor AMX" in choice.describe()


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
                                          weights: torch.dtype) -> None:  # noqa: ANN001 - tiny: a Checkpoint
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls: features))
    engine = LLMEngine(build_engine_config(str(tiny.path)), checkpoint=tiny)
    assert engine.dtype_choice.activations == "float32" and engine.model.dtype == torch.float32
    assert engine.model.layers[0].qkv.dtype == weights
    assert engine.runner.last_weight_form == str(weights).removeprefix("torch.")
