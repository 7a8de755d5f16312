"""Optional C++ kernels for the CPU, built once per source version with the local compiler.

`make install` builds them (`cpu_kernels.main()`); a process that finds no build
compiles them on first use instead. They are an optimisation only: when no compiler is available, the
build fails, the device is not the CPU, or TOKENLOOP_CPU_KERNELS=0 is set, callers fall back to the
pure-PyTorch path, which computes the same thing.

Builds live under ~/.cache/tokenloop/kernels (TOKENLOOP_CACHE_DIR overrides), in a directory named by a
hash of the source, the flags and the torch version. A finished build is imported directly, without
ninja or torch's build lock: checkouts in different directories share it instead of rebuilding in turn
(torch's own cache is keyed by name only, so two checkouts rebuilt each other's kernel on every start).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("paged_decode_attention.cpp", "q8_0_matmul.cpp", "int8_dot_matmul.cpp",
                          "fused_layer_ops.cpp", "decode_layers.cpp")]
_HEADERS = [Path(__file__).parent / "csrc" / "cpu_kernels.h"]  # hashed with the sources: a change rebuilds
_NAME = "tokenloop_paged_decode_attention"
# -march=native is safe: the build runs on the machine that will run it (the hash names the CPU model).
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
_LDFLAGS = ["-fopenmp"]


def kernel_build_dir() -> Path:
    """Where this source version's build lives."""
    base = Path(os.environ.get("TOKENLOOP_CACHE_DIR", Path.home() / ".cache" / "tokenloop")) / "kernels"
    digest = hashlib.sha256()
    parts = [source.read_bytes() for source in _SOURCES + _HEADERS]
    parts += [" ".join(_CFLAGS + _LDFLAGS).encode(), torch.__version__.encode(), sys.version.encode(),
              os.uname().machine.encode(), _cpu_model().encode()]
    for part in parts:
        digest.update(part)
    return base / f"{_NAME}-{digest.hexdigest()[:16]}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line
    except OSError:
        pass
    return ""


def _import_built(path: Path) -> ModuleType | None:
    library = path / f"{_NAME}.so"
    if not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(_NAME, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_kernels() -> ModuleType:
    """Import the built kernels, compiling them first if this source version was never built.

    Raises when the build fails."""
    build_dir = kernel_build_dir()
    module = _import_built(build_dir)
    if module is not None:
        return module
    venv_bin = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin):
        # pip's ninja lands beside the interpreter, which is not on PATH unless the venv is activated.
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    return load(name=_NAME, sources=[str(source) for source in _SOURCES], extra_cflags=_CFLAGS,
                extra_ldflags=_LDFLAGS, build_directory=str(build_dir), verbose=False)


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
        except Exception as exc:  # no compiler, no ninja, headers missing: fall back, loudly once
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
    except Exception as exc:  # the PyTorch path still works; say why the fast one is missing
        print(f"C++ CPU kernels not built ({exc}); tokenloop will use the PyTorch fallbacks")
        return
    print(f"C++ CPU kernels built in {kernel_build_dir()}")
