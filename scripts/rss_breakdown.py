"""Where the resident memory of a loaded engine goes: `/proc/self/smaps` by mapping, and the model's tensors.

Loads the model as the engine does (`EngineCore`: checkpoint with the file's quantized blocks, the dtype
choice, the 1 GiB KV pool), then prints RSS (VmRSS, as `scripts/bench_forward.py`'s ready probe reports it)
split into the GGUF file mapping, torch's libraries, other libraries, the heap and anonymous memory, next to
the bytes the model's own tensors hold by form. One fresh process; the KV pool is in the denominator of the
"RSS / (file + KV pool)" ratio, as in BENCHMARKS.md. The pool's pages are committed as blocks are first
written, so RSS is printed again with every block written once.
Usage: python scripts/rss_breakdown.py [--model NAME] [--dtype auto] [--kv-cache-memory BYTES]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import rss_mb  # VmRSS read the way the ready probe reads it


def smaps_by_kind(file_path: Path) -> dict[str, dict[str, int]]:
    """kB of Rss / Anonymous per kind of mapping (the GGUF file, torch's libraries, ...)."""
    totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    kind = "anonymous"
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if len(fields) >= 5 and "-" in fields[0] and ":" not in fields[0]:  # a mapping's header line
                name = fields[5] if len(fields) > 5 else ""
                if name == str(file_path):
                    kind = "GGUF file (mmap)"
                elif "/torch/" in name:
                    kind = "torch libraries"
                elif name.startswith("["):
                    kind = name
                elif name:
                    kind = "other files / libraries"
                else:
                    kind = "anonymous"
            elif fields and fields[0] in ("Rss:", "Anonymous:"):
                totals[kind][fields[0][:-1]] += int(fields[1])
    return totals


def model_tensor_bytes(model) -> dict[str, int]:  # model: a LlamaModel
    """Bytes of the model's weights by form (each storage counted once)."""
    from tokenloop.model.quantized import Int4Weight, PackedLinear

    seen: set[int] = set()
    totals: dict[str, int] = defaultdict(int)

    def add(kind: str, tensor: torch.Tensor) -> None:
        if tensor.is_mkldnn:
            totals[kind] += tensor.numel() * tensor.element_size()
            return
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            totals[kind] += tensor.untyped_storage().nbytes()

    def add_weight(weight) -> None:
        if isinstance(weight, PackedLinear):
            for pack in getattr(weight.packed, "parts", [weight.packed]):  # a RowStack's parts, or the pack
                if isinstance(pack, Int4Weight):
                    add("int4 packs", pack.packed)
                    add("int4 packs", pack.scales_zeros)
                else:  # Q8_0, the int8-dot and K-quant packs: codes + scales
                    add(f"{pack.form} codes + scales", pack.codes)
                    add(f"{pack.form} codes + scales", pack.scales)
            if weight.dense is not None:
                add(f"dense copies ({str(weight.dense.dtype).removeprefix('torch.')})", weight.dense)
        elif isinstance(weight, torch.Tensor):
            add(f"dense matrices ({str(weight.dtype).removeprefix('torch.')})", weight)

    for layer in model.layers:
        for weight in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            add_weight(weight)
        add("norms", layer.input_norm)
        add("norms", layer.post_attention_norm)
    add_weight(model.lm_head.weight)
    if model.lm_head._packed is not None:
        add("LM head oneDNN copy", model.lm_head._packed)
    embed = model.embed
    if isinstance(embed, torch.Tensor):
        add("embedding", embed)
    add("rope tables", model.rope_cos)
    add("rope tables", model.rope_sin)
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    args = parser.parse_args()

    from tokenloop.config import CacheConfig, EngineConfig
    from tokenloop.core.engine_core import EngineCore
    from tokenloop.model.loader import resolve_model_path

    path = resolve_model_path(args.model)
    imported = rss_mb()  # the interpreter, torch and tokenloop, before any weight
    start = time.perf_counter()
    config = EngineConfig(model=args.model, dtype=args.dtype,
                          cache=CacheConfig(kv_cache_memory_bytes=args.kv_cache_memory))
    core = EngineCore(config)
    ready = time.perf_counter() - start
    rss = rss_mb()
    file_mib = path.stat().st_size / 2**20
    kv_mib = sum(k.nbytes + v.nbytes for k, v in core.runner.kv_caches) / 2**20
    print(f"{path.name}: {file_mib:.1f} MiB; dtype {core.dtype_choice.describe()}")
    print(f"ready {ready:.2f} s; VmRSS {rss:.0f} MiB = {rss / (file_mib + kv_mib):.3f}x (file + {kv_mib:.0f} MiB "
          f"KV pool); {imported:.0f} MiB of it before loading (interpreter, torch, tokenloop imported)")
    print("\n| mapping | RSS MiB | of it anonymous MiB |\n| --- | ---: | ---: |")
    for kind, values in sorted(smaps_by_kind(path).items(), key=lambda kv: -kv[1]["Rss"]):
        if values["Rss"] >= 1024:
            print(f"| {kind} | {values['Rss'] / 1024:.1f} | {values['Anonymous'] / 1024:.1f} |")
    print("\n| model tensors | MiB |\n| --- | ---: |")
    tensors = model_tensor_bytes(core.model)
    for kind, nbytes in sorted(tensors.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {nbytes / 2**20:.1f} |")
    print(f"| KV pool | {kv_mib:.1f} |")
    print(f"| total | {(sum(tensors.values()) / 2**20 + kv_mib):.1f} |")
    # The pool's pages become resident as blocks are first written (tokenloop.model.layers.kv.zeroed_cpu_pool):
    # after load it holds almost none. Written through, it holds all, as a long-running server's does.
    for key, value in core.runner.kv_caches:
        key.fill_(0)
        value.fill_(0)
    full = rss_mb()
    print(f"\nwith every KV block written once: VmRSS {full:.0f} MiB = {full / (file_mib + kv_mib):.3f}x "
          f"(file + KV pool)")


if __name__ == "__main__":
    main()
