"""Compile the Triton attention kernel for a GPU that is not here: `python -m tests.model.triton_aot ARCH [all]`.

Run without TRITON_INTERPRET (a subprocess of the test), so the kernel is a real JITFunction; triton's own
ptxas turns it into a cubin, so every layout's code generation is checked on a machine without a GPU.
Prints one line per compiled variant: by default fp32 and bf16 on the SmolLM2 and Llama-3-8B layouts,
with `all` also fp16 and the tiny test model's layout.
"""

from __future__ import annotations

import inspect
import sys

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from tokenloop.model import triton_attention

POINTERS = {"query": None, "key_cache": None, "value_cache": None, "out": None,
            "block_table": "*i64", "seq_lens": "*i64", "query_starts": "*i64", "query_lens": "*i64"}
# (query heads per KV head, head_dim): SmolLM2-135M, Llama-3-8B, the tiny test model.
LAYOUTS = [(3, 64), (4, 128), (2, 16)]
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _arg_type(param: str, constants: dict[str, object], dtype_name: str) -> str:
    if param in constants:
        return "constexpr"
    if param in POINTERS:
        return POINTERS[param] or f"*{dtype_name}"
    return "fp32" if param == "scale" else "i32"  # the strides


def main(arch: int, every: bool) -> None:
    kernel = triton_attention._paged_attention_kernel
    params = list(inspect.signature(kernel.fn).parameters)
    dtypes = DTYPES if every else {torch.float32: "fp32", torch.bfloat16: "bf16"}
    for dtype, name in dtypes.items():
        for group, head_dim in LAYOUTS if every else LAYOUTS[:2]:
            for decode in (True, False):
                constants = triton_attention.kernel_constants(group, head_dim, 16, decode, dtype)
                signature = {p: _arg_type(p, constants, name) for p in params}
                source = ASTSource(fn=kernel, signature=signature,
                                   constexprs={(params.index(k),): v for k, v in constants.items()})
                compiled = compile(source, target=GPUTarget("cuda", arch, 32))
                print(f"sm_{arch} {name} group={group} head_dim={head_dim} decode={decode} "
                      f"cubin={len(compiled.asm['cubin'])} shared={compiled.metadata.shared}")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:] == ["all"])
