"""Optional C++ kernels for the CPU, compiled on first use with the local compiler.

They are an optimisation only: when no compiler is available, the build fails, the device is not the
CPU, or TOKENLOOP_CPU_KERNELS=0 is set, callers fall back to the pure-PyTorch path, which computes
the same thing. The build is cached by torch under TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"


class _KernelLoader:
    """Builds the extension once per process, on first request, and remembers a failure."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._tried = False

    def get(self) -> ModuleType | None:
        if self._tried:
            return self._module
        with self._lock:
            if not self._tried:
                self._module = self._build()
                self._tried = True
        return self._module

    @staticmethod
    def _build() -> ModuleType | None:
        if os.environ.get("TOKENLOOP_CPU_KERNELS", "1") == "0":
            return None
        venv_bin = str(Path(sys.executable).parent)
        if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin):
            # pip's ninja lands beside the interpreter, which is not on PATH unless the venv is activated.
            os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
        try:
            from torch.utils.cpp_extension import load

            # -march=native is safe: the build runs on the machine that will run it.
            return load(name="tokenloop_paged_decode_attention", sources=[str(_SOURCE)],
                        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # no compiler, no ninja, headers missing: fall back, loudly once
            logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch attention path", exc)
            return None


_loader = _KernelLoader()


def paged_decode_kernels() -> ModuleType | None:
    """The compiled decode-attention module, or None when it cannot be had."""
    return _loader.get()
