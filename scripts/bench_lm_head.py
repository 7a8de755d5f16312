"""The tied LM head's GEMM, `[M, K] x [K, N]` (default 576 x 49152), in each form the head can run in.

Forms, interleaved within each round (the machine is shared, so they see the same load), median of the rounds:
- `q8_tiled`: the Q8_0 kernel on the 16-column tiled codes (`Q8Weight`, csrc/q8_0_matmul.cpp), fp32 out;
- `fp32_mkldnn`: a float32 copy of the dequantized weights, oneDNN-packed (what the head used above 8 rows);
- `fp32_prepacked`: the same copy reordered once for `mkldnn._linear_pointwise` (dense input and output);
- `q8_rowmajor`: the previous Q8_0 kernel on row-major codes, when `--old-source FILE` names its source
  (e.g. `git show 25e628d:tokenloop/model/csrc/q8_0_matmul.cpp > /tmp/old_q8.cpp`); built here as its own
  small extension.
Usage: python scripts/bench_lm_head.py [--rows 1,2,4,...] [--rounds 7] [--old-source FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from tokenloop.model.cpu_kernels import (
    _CFLAGS,
    _LDFLAGS,
    kernel_build_dir,
    paged_decode_kernels,
)
from tokenloop.model.quantized import Q8Weight


def time_call(fn: Callable[[], object], min_seconds: float) -> float:
    """Seconds per call: calls repeated until `min_seconds` have passed (at least 2)."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if calls >= 2 and elapsed >= min_seconds:
            return elapsed / calls


def build_old_kernel(source: Path) -> ModuleType:
    """The row-major kernel `q8_0_matmul(x, codes, scales, out)` of `source`, as an extension of its own."""
    from torch.utils.cpp_extension import load

    build = kernel_build_dir().parent / "bench_q8_rowmajor"
    build.mkdir(parents=True, exist_ok=True)
    binding = build / "binding.cpp"
    binding.write_text("#include <torch/extension.h>\n"
                       "void q8_0_matmul(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,"
                       " torch::Tensor&);\n"
                       "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"q8_0_matmul\", &q8_0_matmul); }\n")
    copy = build / "q8_0_matmul_old.cpp"
    copy.write_text(source.read_text())
    return load(name="bench_q8_rowmajor", sources=[str(copy), str(binding)], extra_cflags=_CFLAGS,
                extra_ldflags=_LDFLAGS, build_directory=str(build))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--n", type=int, default=49152)
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-seconds", type=float, default=0.05, help="per form, per round")
    parser.add_argument("--old-source", type=Path, help="source of the row-major q8_0_matmul to compare")
    args = parser.parse_args()
    old = build_old_kernel(args.old_source) if args.old_source else None
    if paged_decode_kernels() is None:
        raise SystemExit("the C++ kernels are not available (TOKENLOOP_CPU_KERNELS=0 or no compiler)")
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (args.n, args.k), dtype=torch.int8, generator=gen)
    scales = torch.rand(args.n, args.k // 32, generator=gen) * 1e-2
    tiled = Q8Weight.from_codes(codes, scales)
    dense = tiled.dequantize().to_mkldnn()
    prepacked = torch.ops.mkldnn._reorder_linear_weight(tiled.dequantize())
    print(f"[M, {args.k}] x [{args.k}, {args.n}], {torch.get_num_threads()} threads, median of {args.rounds} "
          "interleaved rounds, ms per call")
    names = ["q8_tiled", "fp32_mkldnn", "fp32_prepacked"] + (["q8_rowmajor"] if old else [])
    print("| M | " + " | ".join(names) + " |")
    print("| ---: |" + " ---: |" * len(names))
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, args.k, generator=gen)
        out = torch.empty(rows, args.n)
        forms: dict[str, Callable[[], object]] = {
            "q8_tiled": lambda x=x: tiled.matmul(x),
            "fp32_mkldnn": lambda x=x: torch._C._nn.mkldnn_linear(x.to_mkldnn(), dense, None).to_dense(),
            "fp32_prepacked": lambda x=x: torch.ops.mkldnn._linear_pointwise(x, prepacked, None, "none", [], ""),
        }
        if old is not None:
            forms["q8_rowmajor"] = lambda x=x, out=out: old.q8_0_matmul(x, codes, scales, out)
        samples: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(args.rounds):
            for name, fn in forms.items():
                samples[name].append(time_call(fn, args.min_seconds))
        medians = [statistics.median(samples[name]) * 1e3 for name in names]
        print(f"| {rows} | " + " | ".join(f"{m:.2f}" for m in medians) + " |", flush=True)


if __name__ == "__main__":
    main()
