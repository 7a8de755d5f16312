"""Paged attention must equal dense causal attention, whatever the paging and batching."""

from __future__ import annotations

import random
from types import ModuleType

import pytest
import torch

from tokenloop.model.attention import AttentionMetadata, dense_causal_attention, paged_attention
from tokenloop.model.cpu_kernels import paged_decode_kernels


def _run_paged_in_chunks(
    sequences: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    chunk_plan: list[list[int]],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    rng: random.Random,
    kernel: ModuleType | None = None,
    kv_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Feed each sequence through paged attention in the given chunk sizes, all sequences per step
    in one ragged batch, with blocks scattered randomly over the pool. Returns per-sequence outputs."""
    num_blocks = sum((q.shape[0] + block_size - 1) // block_size for q, _, _ in sequences) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for q, _, _ in sequences:
        needed = (q.shape[0] + block_size - 1) // block_size
        tables.append([free.pop() for _ in range(needed)])
    max_blocks = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(kv_dtype)  # garbage must not leak
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(kv_dtype)
    outputs = [torch.empty_like(q) for q, _, _ in sequences]
    done = [0] * len(sequences)
    for step in range(max(len(plan) for plan in chunk_plan)):
        rows, starts, seq_lens, q_parts, k_parts, v_parts, slots = [], [0], [], [], [], [], []
        for i, (q, k, v) in enumerate(sequences):
            if step >= len(chunk_plan[i]):
                continue
            n = chunk_plan[i][step]
            lo, hi = done[i], done[i] + n
            rows.append((i, lo, hi))
            starts.append(starts[-1] + n)
            seq_lens.append(hi)
            q_parts.append(q[lo:hi])
            k_parts.append(k[lo:hi])
            v_parts.append(v[lo:hi])
            positions = torch.arange(lo, hi)
            table = torch.tensor(tables[i])
            slots.append(table[positions // block_size] * block_size + positions % block_size)
            done[i] = hi
        table_rows = torch.stack([block_table[i] for i, _, _ in rows])
        meta = AttentionMetadata.build(starts, seq_lens, table_rows, torch.cat(slots), block_size, kernel)
        out = paged_attention(torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts),
                              key_cache, value_cache, meta, scale)
        for (i, lo, hi), begin, end in zip(rows, starts, starts[1:]):
            outputs[i][lo:hi] = out[begin:end]
    return outputs


def _decode_kernel(name: str) -> ModuleType | None:
    if name == "torch":
        return None
    kernel = paged_decode_kernels()
    if kernel is None:
        pytest.skip("the C++ decode kernel could not be built here")
    return kernel


@pytest.mark.parametrize("decode", ["torch", "cpp"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: the C++ kernel's register path (16: its generic loop)
def test_paged_attention_equals_dense(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                                      decode: str) -> None:
    kernel = _decode_kernel(decode)
    rng = random.Random(block_size * 100 + num_heads + head_dim)
    torch.manual_seed(rng.randrange(1 << 30))
    scale = head_dim ** -0.5
    lengths = [1, 5, 17, 33, 40]
    sequences = [(torch.randn(n, num_heads, head_dim), torch.randn(n, num_kv_heads, head_dim),
                  torch.randn(n, num_kv_heads, head_dim)) for n in lengths]
    # Ragged chunking: a whole prompt at once, chunks of 7, and token-by-token decoding after a prefill.
    plans = []
    for n in lengths:
        kind = rng.randrange(3)
        if kind == 0:
            plans.append([n])
        elif kind == 1:
            plans.append([7] * (n // 7) + ([n % 7] if n % 7 else []))
        else:
            first = rng.randint(1, n)
            plans.append([first] + [1] * (n - first))
    outputs = _run_paged_in_chunks(sequences, plans, block_size, num_kv_heads, head_dim, scale, rng, kernel)
    for (q, k, v), out in zip(sequences, outputs):
        torch.testing.assert_close(out, dense_causal_attention(q, k, v, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decode", ["torch", "cpp"])
def test_decode_batch_with_uneven_lengths_ignores_padding(decode: str) -> None:
    kernel = _decode_kernel(decode)
    """Decode rows of very different context lengths share one padded batch; padding must not leak."""
    rng = random.Random(7)
    torch.manual_seed(7)
    lengths = [1, 2, 64, 3]
    sequences = [(torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)) for n in lengths]
    plans = [[n - 1, 1] if n > 1 else [1] for n in lengths]
    plans[0] = [1]
    outputs = _run_paged_in_chunks(sequences, plans, 4, 2, 8, 0.35, rng, kernel)
    for (q, k, v), out in zip(sequences, outputs):
        torch.testing.assert_close(out, dense_causal_attention(q, k, v, 0.35), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decode", ["torch", "cpp"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [16, 64, 128])  # 64 / 128: the C++ register path; 16: its generic loop
def test_bf16_kv_cache_attends_as_the_rounded_keys_and_values(block_size: int, num_heads: int, num_kv_heads: int,
                                                               head_dim: int, decode: str) -> None:
    """A bf16 KV cache with fp32 queries: ragged contexts over several blocks, GQA, prefill chunks and decode
    rows in one batch. The output is fp32 attention over K/V rounded to bf16 (sums in fp32), and within bf16
    precision of attention over the unrounded fp32 K/V."""
    kernel = _decode_kernel(decode)
    rng = random.Random(block_size * 1000 + num_heads * 10 + head_dim)
    torch.manual_seed(rng.randrange(1 << 30))
    scale = head_dim ** -0.5
    lengths = [1, 6, 19, 40, 70]
    sequences = [(torch.randn(n, num_heads, head_dim), torch.randn(n, num_kv_heads, head_dim),
                  torch.randn(n, num_kv_heads, head_dim)) for n in lengths]
    plans = []
    for n in lengths:  # a prefill, chunks, then token-by-token decode: every read path sees the bf16 cache
        first = rng.randint(1, n)
        rest = n - first
        chunk = min(rest, rng.randint(0, 8))
        plans.append([first] + ([chunk] if chunk else []) + [1] * (rest - chunk))
    outputs = _run_paged_in_chunks(sequences, plans, block_size, num_kv_heads, head_dim, scale, rng, kernel,
                                   kv_dtype=torch.bfloat16)
    for (q, k, v), out in zip(sequences, outputs):
        rounded = dense_causal_attention(q, k.bfloat16().float(), v.bfloat16().float(), scale)
        torch.testing.assert_close(out, rounded, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, dense_causal_attention(q, k, v, scale), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (9, 3)])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])  # 64 / 128: the register path; 16, 256: the generic loop
@pytest.mark.parametrize("window", [1, 6, 13])
def test_cpp_decode_attends_only_the_window(window: int, head_dim: int, num_heads: int, num_kv_heads: int,
                                            kv_dtype: torch.dtype) -> None:
    """A sliding layer's decode rows: each query attends only its `window` latest keys. The blocks wholly before
    the window are released (id -1 in the table, as a sliding KV group's) and hold NaN: reading one shows."""
    kernel = _decode_kernel("cpp")
    assert kernel is not None and kernel.decode_attention_window
    block_size, lengths = 4, [1, 3, 6, 7, 14, 29]
    gen = torch.Generator().manual_seed(window * 1000 + head_dim + num_heads)
    blocks_each = (max(lengths) + block_size - 1) // block_size
    num_blocks = len(lengths) * blocks_each
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    value_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    table = torch.randperm(num_blocks, generator=gen).view(len(lengths), blocks_each)
    for row, length in enumerate(lengths):
        passed = max(0, length - window) // block_size
        key_cache[table[row, :passed]] = value_cache[table[row, :passed]] = float("nan")
        table[row, :passed] = -1
    query = torch.randn(len(lengths), num_heads, head_dim, generator=gen)
    out = torch.empty_like(query)
    scale = head_dim ** -0.5
    kernel.paged_decode_attention(query, key_cache, value_cache, table, torch.tensor(lengths), scale, out, window)
    group = num_heads // num_kv_heads
    for row, length in enumerate(lengths):
        positions = torch.arange(max(0, length - window), length)
        slots = table[row, positions // block_size] * block_size + positions % block_size
        keys = key_cache.view(-1, num_kv_heads, head_dim)[slots].float().repeat_interleave(group, dim=1)
        values = value_cache.view(-1, num_kv_heads, head_dim)[slots].float().repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,khd->hk", query[row], keys) * scale).softmax(-1)
        torch.testing.assert_close(out[row], torch.einsum("hk,khd->hd", weights, values), rtol=1e-5, atol=1e-5)
