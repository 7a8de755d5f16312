"""The Triton paged-attention kernel must match the gather + SDPA reference on every paging and batching.

On a machine without CUDA it runs under the Triton interpreter (TRITON_INTERPRET=1, which tests/conftest.py
sets before anything imports triton), so CI checks the real kernel's indexing, masks and softmax on the CPU.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.model.paged_harness import random_paged_step
from tests.model.test_llama import _mixed_step_logits, _prompts
from tokenloop.model.attention import AttentionMetadata, paged_attention
from tokenloop.model.models.llama import LlamaModel

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.triton

from tokenloop.model import triton_attention  # after the skip: triton may be missing

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO = Path(__file__).resolve().parents[2]
if DEVICE == "cpu":
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must switch the interpreter on"


def _both(lengths: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
          dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's output and the kernel's for the same step, each on its own copy of the caches."""
    s = random_paged_step(lengths, num_heads, num_kv_heads, head_dim, block_size, dtype, DEVICE, seed)
    scale = head_dim ** -0.5
    reference_meta = AttentionMetadata.build(s.starts, s.seq_lens, s.block_table, s.slots, block_size)
    kernel_meta = AttentionMetadata.build(s.starts, s.seq_lens, s.block_table, s.slots, block_size,
                                          triton_attention, triton_attention)
    reference = paged_attention(s.query, s.key, s.value, s.key_cache.clone(), s.value_cache.clone(),
                                reference_meta, scale)
    kernel = paged_attention(s.query, s.key, s.value, s.key_cache.clone(), s.value_cache.clone(), kernel_meta, scale)
    return reference, kernel


# SmolLM2-135M: 9 query heads on 3 KV heads; Llama-3-8B: 32 on 8, head_dim 128; plus MHA.
HEADS = [(9, 3, 64), (32, 8, 128), (4, 4, 16)]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
def test_mixed_step_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Decode rows of ragged lengths next to fresh prompts, chunks after a cached context and a prefix hit
    ending mid-block: last blocks partly filled, one chunk longer than a query tile."""
    lengths = [(0, 1), (20, 1), (47, 1), (0, 37), (16, 9), (33, 70), (5, 1)]
    reference, kernel = _both(lengths, num_heads, num_kv_heads, head_dim, 16, torch.float32, seed=head_dim)
    torch.testing.assert_close(kernel, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_match_reference(seed: int) -> None:
    rng = random.Random(seed)
    num_kv_heads = rng.choice([1, 2, 3])
    num_heads = num_kv_heads * rng.choice([1, 2, 3, 4, 5])
    block_size = rng.choice([1, 4, 16, 32])
    lengths = [(rng.choice([0, rng.randrange(1, 90)]), rng.choice([1, 1, rng.randrange(2, 40)]))
               for _ in range(rng.randrange(1, 6))]
    reference, kernel = _both(lengths, num_heads, num_kv_heads, 32, block_size, torch.float32, seed)
    torch.testing.assert_close(kernel, reference, rtol=1e-4, atol=1e-4)


def test_decode_only_and_prefill_only_batches() -> None:
    for lengths in ([(15, 1), (16, 1), (17, 1), (100, 1)], [(0, 16), (0, 17), (3, 2)]):
        reference, kernel = _both(lengths, 9, 3, 64, 16, torch.float32, seed=len(lengths))
        torch.testing.assert_close(kernel, reference, rtol=1e-4, atol=1e-4)


def test_half_precision_within_tolerance() -> None:
    """fp16 K/V and queries (the interpreter has no bf16: numpy lacks it); fp32 accumulation inside."""
    lengths = [(0, 1), (30, 1), (0, 24), (18, 20)]
    reference, kernel = _both(lengths, 9, 3, 64, 16, torch.float16, seed=3)
    torch.testing.assert_close(kernel.float(), reference.float(), rtol=2e-2, atol=2e-2)


def test_bad_shapes_are_refused() -> None:
    q = torch.zeros(2, 6, 24)
    cache = torch.zeros(4, 16, 3, 24)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        triton_attention.paged_decode_attention(q, cache, cache, torch.zeros(2, 1, dtype=torch.long),
                                                torch.ones(2, dtype=torch.long), 1.0, torch.empty_like(q))
    cache = torch.zeros(4, 16, 4, 32)
    q = torch.zeros(2, 6, 32)
    with pytest.raises(ValueError, match="not a multiple"):
        triton_attention.paged_decode_attention(q, cache, cache, torch.zeros(2, 1, dtype=torch.long),
                                                torch.ones(2, dtype=torch.long), 1.0, torch.empty_like(q))


def test_model_forward_with_the_kernel_matches_the_reference(tiny) -> None:  # tiny: a Checkpoint
    """Through the decoder itself: its queries are a strided view of the fused QKV output, not contiguous."""
    reference = LlamaModel.from_weights(tiny.config, tiny.weights, use_cpu_kernels=False)
    kernel = LlamaModel.from_weights(tiny.config, tiny.weights, use_cpu_kernels=False)
    kernel.decode_kernel = kernel.prefill_kernel = triton_attention
    prompts = _prompts(tiny.config.vocab_size, seed=5, shared_prefix=32)
    for ours, theirs in zip(_mixed_step_logits(kernel, prompts, 16), _mixed_step_logits(reference, prompts, 16)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_the_kernel_compiles_for_hopper_without_a_gpu() -> None:
    """Code generation down to an sm_90 cubin (triton's bundled ptxas) for every layout and dtype the
    engine launches: what the interpreter cannot check (dot shapes, layouts, register and shared memory)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": str(REPO), "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run([sys.executable, "-m", "tests.model.triton_aot", "90"], capture_output=True,
                            text=True, timeout=900, env=env, cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("sm_90")]
    assert len(lines) == 8 and all("cubin=" in line for line in lines), result.stdout
