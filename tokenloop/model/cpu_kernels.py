"""Optional C++ kernels for the CPU, built once per source version with the local compiler.

`make install` builds them (`cpu_kernels.main()`); a process that finds no build
compiles them on first use instead. They are an optimisation only: when no compiler is available, the
build fails, the device is not the CPU, or TOKENLOOP_CPU_KERNELS=0 is set, callers fall back to the
pure-PyTorch path, which computes the same thing.

Builds live under ~/.cache/tokenloop/kernels (TOKENLOOP_CACHE_DIR overrides), in a directory named by a
hash of the source, the flags (the target, `-march=native` unless TOKENLOOP_KERNEL_MARCH names another, e.g.
`x86-64-v3` for AVX2 + FMA + F16C without AVX-512: the AVX2 paths can then be tested on an AVX-512 machine)
and the torch version. A finished build is imported directly, without ninja or torch's build lock: checkouts
in different directories share it instead of rebuilding in turn (torch's own cache is keyed by name only, so
two checkouts rebuilt each other's kernel on every start).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("paged_decode_attention.cpp", "q8_0_matmul.cpp", "int8_dot_matmul.cpp",
                          "fused_layer_ops.cpp", "decode_layers.cpp", "weight_unpack.cpp",
                          "lora_sgmv.cpp", "int8_gemm.cpp", "moe_experts.cpp")]
# Hashed with the sources: a change rebuilds.
_HEADERS = [Path(__file__).parent / "csrc" / name for name in ("cpu_kernels.h", "int8_pack_simd.h",
                                                                  "kquant_dot_blocks.inc", "int8_dot_tiles.inc")]
_NAME = "tokenloop_paged_decode_attention"
_CFLAGS = ["-O3", "-fopenmp", "-ffast-math"]
_LDFLAGS = ["-fopenmp"]
_MARCH_VARIABLE = "TOKENLOOP_KERNEL_MARCH"


def kernel_march() -> str:
    """The compiler's -march for the kernels: `native` (the build runs on the machine that will run it, and
    the hash names the CPU model), or TOKENLOOP_KERNEL_MARCH (e.g. `x86-64-v3`). ValueError when malformed."""
    march = os.environ.get(_MARCH_VARIABLE, "native") or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", march):
        raise ValueError(f"{_MARCH_VARIABLE}={march!r} is not a -march value (e.g. native, x86-64-v3)")
    return march


def _cflags(march: str) -> list[str]:
    return [*_CFLAGS, f"-march={march}"]


def kernel_build_dir(march: str | None = None) -> Path:
    """Where this source version's build for `march` (default: `kernel_march()`) lives."""
    base = Path(os.environ.get("TOKENLOOP_CACHE_DIR", Path.home() / ".cache" / "tokenloop")) / "kernels"
    digest = hashlib.sha256()
    parts = [source.read_bytes() for source in _SOURCES + _HEADERS]
    parts += [" ".join(_cflags(march or kernel_march()) + _LDFLAGS).encode(), torch.__version__.encode(),
              sys.version.encode(), os.uname().machine.encode(), _cpu_model().encode()]
    for part in parts:
        digest.update(part)
    return base / f"{_NAME}-{digest.hexdigest()[:16]}"


@functools.cache  # the machine's constant: read once, not per packed matrix
def _cpu_model() -> str:
    """The first CPU's model name and flags: -march=native code built for one CPU may not run on another
    (two EPYC generations both say "AMD EPYC", one with AVX-512 and one without)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    model = next((line for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith("flags")), "")
    return f"{model}\n{flags}"


def compiled_isa(kernels: ModuleType | None) -> frozenset[str] | None:
    """The instruction sets a loaded build targets (`avx2`, `avx512f`, `avx512vnni`, ...), as the kernels
    report them; None for no build, or one too old to say."""
    if kernels is None or not hasattr(kernels, "compiled_isa"):
        return None
    return frozenset(kernels.compiled_isa().split())


def avx512_native() -> bool:
    """Whether the kernels' AVX-512 paths run here: what the loaded build was compiled for (its -march), or
    the CPU's flags when there is no build. Without them the Q8_0 tiled kernel runs plain loops, several times
    slower than oneDNN's float32 GEMM (BENCHMARKS.md, AVX2)."""
    isa = compiled_isa(paged_decode_kernels())
    if isa is not None:
        return "avx512f" in isa
    return "avx512f" in _cpu_model().rpartition("\n")[2].split()


def _module_name(march: str) -> str:
    """The extension's module name for a build: another target's gets its own, so that one process can load it
    beside the native build (tests of the AVX2 path; two extensions of one name would collide)."""
    return _NAME if march == "native" else f"{_NAME}_{re.sub(r'[^A-Za-z0-9]', '_', march)}"


def _import_built(path: Path, name: str) -> ModuleType | None:
    library = path / f"{name}.so"
    if not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_kernels(march: str | None = None) -> ModuleType:
    """Import the built kernels for `march` (default: `kernel_march()`), compiling them first if this source
    version was never built for it.

    Raises when the build fails."""
    march = march or kernel_march()
    build_dir = kernel_build_dir(march)
    module = _import_built(build_dir, _module_name(march))
    if module is not None:
        return module
    venv_bin = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin):
        # pip's ninja lands beside the interpreter, which is not on PATH unless the venv is activated.
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    return load(name=_module_name(march), sources=[str(source) for source in _SOURCES],
                extra_cflags=_cflags(march), extra_ldflags=_LDFLAGS, build_directory=str(build_dir), verbose=False)


class _KernelLoader:
    """Loads the extension once per process, on first request, and remembers a failure."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._tried = False

    def get(self) -> ModuleType | None:
        if self._tried:
            return self._module
        with self._lock:
            if not self._tried:
                self._module = self._load()
                self._tried = True
        return self._module

    @staticmethod
    def _load() -> ModuleType | None:
        if os.environ.get("TOKENLOOP_CPU_KERNELS", "1") == "0":
            return None
        try:
            return build_kernels()
        except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, headers missing: fall back, loudly once
            logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch attention path", exc)
            return None


_loader = _KernelLoader()


def paged_decode_kernels() -> ModuleType | None:
    """The compiled decode-attention module, or None when it cannot be had."""
    return _loader.get()


def main() -> None:
    """`make install`: build now, so that no server start waits for the compiler."""
    try:
        build_kernels()
    except Exception as exc:  # noqa: BLE001 - the PyTorch path still works; say why the fast one is missing
        print(f"C++ CPU kernels not built ({exc}); tokenloop will use the PyTorch fallbacks")
        return
    print(f"C++ CPU kernels built in {kernel_build_dir()} (-march={kernel_march()})")
