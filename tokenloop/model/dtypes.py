"""Which number formats a model runs in: `dtype="auto"` resolved against the CPU and the checkpoint.

`auto` keeps the residual stream and attention's sums in float32 and picks the projection weights' form:

- a quantized GGUF (Q4_0 / Q4_1 / Q4_K / Q8_0) on a CPU with AVX512-BF16 or AMX: the file's own blocks, packed
  for the int4 / Q8_0 kernels for small batches, plus a dense copy for large ones (`quantized`);
- any other checkpoint on such a CPU: bf16 weights (half the bytes, native bf16 dot products);
- a quantized GGUF on a CPU without native bf16 (AVX2 only, e.g. AMD Zen 3): the packed forms for small
  batches as above, but a float32 copy for large ones: measured on a 2-core Zen 3 (BENCHMARKS.md, issue 11,
  "AVX2"), packed beats fp32 weights 2.4x at one row and 1.4x at eight, while a bf16 GEMM without native
  bf16 is the slowest form above that (55 tok/s at 32 rows against fp32's 142; prefill 74 against 357);
- any other checkpoint without native bf16: float32.

The KV cache (`kv_cache_dtype`): `auto` stores K/V in bfloat16 on the CPU when `dtype` is `auto` (float32
activations). Decode attention streams every cached K/V row each step (46 KB a token in fp32 for the default
model: at 32 streams of ~200 tokens more bytes than the Q4 weights); bf16 halves them, and the kernel widens
each row to fp32 as it loads it (a 16-bit shift: no bf16 arithmetic, so native bf16 is not needed), so the
sums stay fp32. Measured on an AVX2-only EPYC (BENCHMARKS.md, issue 11, "A bfloat16 KV cache") and on an
AVX-512 one (BENCHMARKS.md, "Side by side again on an AVX-512 machine"). Teacher-forced top-1
agreement with the fp32 model stays >= 98% (tests/model/test_quantized_real_model.py). An explicit `dtype`
(float32 for the HF parity tests) keeps the KV cache in that dtype; `float32` / `bfloat16` force it.

On CUDA `auto` is bf16 throughout (activations, KV cache, weights): tensor cores run bf16 natively and the
KV cache's bytes are what decode streams. A quantized GGUF is dequantized to bf16 there (no int4 GPU kernels).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenloop.config import ModelConfig
from tokenloop.errors import ConfigError, UnsupportedModelError
from tokenloop.model import registry
from tokenloop.model.ggml_tensor import GGMLTensor
from tokenloop.model.models.llama import LlamaModel

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class CpuFeatures:
    """The instruction-set extensions the dtype choice depends on."""

    avx512_bf16: bool = False
    amx_bf16: bool = False

    @property
    def native_bf16(self) -> bool:
        return self.avx512_bf16 or self.amx_bf16

    @classmethod
    def detect(cls, cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuFeatures:
        """Read the flags of this machine (Linux); a machine without /proc/cpuinfo has none."""
        try:
            text = cpuinfo.read_text()
        except OSError:
            return cls()
        flags: set[str] = set()
        for line in text.splitlines():
            if line.startswith("flags"):
                flags.update(line.partition(":")[2].split())
                break
        return cls(avx512_bf16="avx512_bf16" in flags, amx_bf16="amx_bf16" in flags)


@dataclass(frozen=True)
class DtypeChoice:
    """The resolved forms: `activations` (residual stream, attention's sums), `weights`, the projections'
    form: float32 / float16 / bfloat16 or `quantized` (packed int4 / Q8_0 + dense copy), and `kv_cache`,
    the dtype K/V are stored in (`kv_reason` says why)."""

    activations: str
    weights: str
    reason: str
    kv_cache: str = ""  # "": the activations' dtype
    dense_copy: str = "bfloat16"  # with weights "quantized": the large-batch copy's dtype
    kv_reason: str = ""

    def __post_init__(self) -> None:
        if not self.kv_cache:
            object.__setattr__(self, "kv_cache", self.activations)

    def describe(self) -> str:
        if self.kv_cache == self.activations:
            return f"activations and KV cache {self.activations}, weights {self.weights} ({self.reason})"
        return (f"activations {self.activations}, KV cache {self.kv_cache} ({self.kv_reason}), "
                f"weights {self.weights} ({self.reason})")


def resolve_dtype(dtype: str, weight_dtype: str | None, device: str, quantized_checkpoint: bool,
                  features: CpuFeatures, kv_cache_dtype: str = "auto") -> DtypeChoice:
    """Resolve `EngineConfig.dtype` / `weight_dtype` / `kv_cache_dtype` (auto / None) into concrete forms."""
    choice = _resolve_forms(dtype, weight_dtype, device, quantized_checkpoint, features)
    on_cpu = torch.device(device).type == "cpu"
    if kv_cache_dtype != "auto":
        if not on_cpu and kv_cache_dtype != choice.activations:
            raise ConfigError(f"kv_cache_dtype {kv_cache_dtype} differs from the activations' "
                              f"{choice.activations} on {device}: only the CPU kernels read another KV dtype "
                              "(use kv_cache_dtype auto there)")
        return dataclasses.replace(choice, kv_cache=kv_cache_dtype, kv_reason="as configured")
    if on_cpu and dtype == "auto" and choice.activations == "float32":
        return dataclasses.replace(choice, kv_cache="bfloat16",
                                   kv_reason="auto: half the bytes decode attention reads, fp32 sums")
    return choice


def _resolve_forms(dtype: str, weight_dtype: str | None, device: str, quantized_checkpoint: bool,
                   features: CpuFeatures) -> DtypeChoice:
    """Activations and weights (the KV cache follows the activations until `resolve_dtype` decides)."""
    on_cpu = torch.device(device).type == "cpu"
    if dtype != "auto":
        weights = weight_dtype or dtype
        return DtypeChoice(dtype, _check_quantized(weights, on_cpu, quantized_checkpoint), "as configured")
    if weight_dtype is not None:
        return DtypeChoice("float32", _check_quantized(weight_dtype, on_cpu, quantized_checkpoint),
                           "weights as configured")
    if torch.device(device).type == "cuda":
        return DtypeChoice("bfloat16", "bfloat16", f"auto on {device}: bf16 activations, KV cache and weights")
    if not on_cpu:
        return DtypeChoice("float32", "float32", f"auto on {device}: no CPU kernels to choose from")
    if not features.native_bf16 and quantized_checkpoint:
        return DtypeChoice("float32", "quantized",
                           "auto: quantized GGUF on a CPU without AVX512-BF16 or AMX: packed int4 / Q8_0 for "
                           "small batches, float32 for large ones", dense_copy="float32")
    if not features.native_bf16:
        return DtypeChoice("float32", "float32", "auto: this CPU has neither AVX512-BF16 nor AMX")
    if quantized_checkpoint:
        return DtypeChoice("float32", "quantized",
                           "auto: quantized GGUF on a CPU with native bf16: packed int4 / Q8_0 for small "
                           "batches, bf16 for large ones")
    return DtypeChoice("float32", "bfloat16", "auto: float checkpoint on a CPU with native bf16")


def require_device(device: str) -> None:
    """Raise ConfigError now, before any weight is loaded, if `device` cannot run here."""
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        build = f"torch {torch.__version__} " + ("has no CUDA support" if torch.version.cuda is None
                                                 else "sees no CUDA device")
        raise ConfigError(f"device {device!r} was asked for, but {build}; use --device cpu")
    if kind == "cuda":
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s)")


def _check_quantized(weights: str, on_cpu: bool, quantized_checkpoint: bool) -> str:
    """`quantized` needs packed blocks and the CPU kernels; elsewhere it degrades to bf16 weights."""
    if weights != "quantized":
        return weights
    if not on_cpu or not quantized_checkpoint:
        logger.warning("weight_dtype=quantized needs a quantized GGUF on the CPU; using bfloat16 weights")
        return "bfloat16"
    return weights


def build_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor | GGMLTensor],
    choice: DtypeChoice,
    device: str,
    max_positions: int,
) -> LlamaModel:
    """The model of `config.architecture` (model/registry.py) in the chosen forms."""
    quantized = choice.weights == "quantized"
    family = registry.model_class(config.architecture)
    if not (isinstance(family, type) and issubclass(family, LlamaModel)):  # every family's parent (models/)
        raise UnsupportedModelError(f"{config.architecture}: {family!r} is not a decoder model class")
    model = family.from_weights(
        config, weights, device=device, dtype=DTYPES[choice.activations], max_positions=max_positions,
        weight_dtype=None if quantized else DTYPES[choice.weights], quantized=quantized,
        dense_copy_dtype=DTYPES[choice.dense_copy],
        kv_dtype=DTYPES[choice.kv_cache])
    _return_freed_memory()
    return model


def _return_freed_memory() -> None:
    """Hand the per-tensor conversion buffers glibc keeps in its arenas back to the OS (~60 MB here)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim, nothing lost
        pass
