"""Paged attention in Triton: the GPU twin of the C++ decode kernel (`csrc/paged_decode_attention.cpp`).

One kernel reads K/V in place through the block table, for decode rows and prefill chunks alike; the
reference it must match is the gather + SDPA path in `attention.py`. A program owns one request, one KV
head and one tile of that request's query tokens. Its M rows are (query token, query head of the group)
pairs, so the heads that share a KV head read each K/V tile once (GQA without repeating K/V). Keys are
walked in tiles of BLOCK_N token positions, each position's block id looked up in the table, with an
online softmax in float32; causality is aligned bottom-right (a chunk's queries follow the cached context).

Decode rows are launched with one query token per tile (M = the group, padded to 16 for `tl.dot`), prefill
chunks with as many tokens as fill BLOCK_M rows. The grid's third axis covers the longest chunk; tiles past a
shorter request's end return at once. fp32 inputs use IEEE dot products (TF32 would change greedy tokens
against the CPU); fp16 / bf16 inputs multiply in their own type with fp32 accumulation.

Tested on the CPU under the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows and columns


# long: one Triton program: its signature alone (pointers, strides, compile-time sizes) is 20 lines, then an
# online-softmax loop whose running max, sum and accumulator stay in registers across the KV blocks.
@triton.jit
def _paged_attention_kernel(
    query, key_cache, value_cache, out,
    block_table, seq_lens, query_starts, query_lens,
    scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # rows per tile, >= BLOCK_Q * GROUP_PAD and >= 16
    BLOCK_N: tl.constexpr,  # key positions per inner iteration
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,  # tokens per KV-cache block
    DECODE: tl.constexpr,  # one query per request, at flat row b (query_starts / query_lens unused)
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    if DECODE:
        q_start = b
        q_len = 1
    else:
        q_start = tl.load(query_starts + b).to(tl.int32)
        q_len = tl.load(query_lens + b).to(tl.int32)
    tile_start = tile * BLOCK_Q
    if tile_start < q_len:
        context_len = seq_len - q_len  # tokens cached before this step's chunk
        rows = tl.arange(0, BLOCK_M)
        q_local = rows // GROUP_PAD
        g = rows % GROUP_PAD
        q_index = tile_start + q_local  # within the request's chunk
        row_valid = (g < GROUP) & (q_local < BLOCK_Q) & (q_index < q_len)
        head = kv_head * GROUP + g
        d = tl.arange(0, HEAD_DIM)
        token = q_start + q_index
        q = tl.load(query + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_valid[:, None], other=0.0)
        # A row attends keys 0 .. its own position; every row sees key 0, so no row's maximum stays -inf.
        query_pos = context_len + q_index
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        kv_end = tl.minimum(seq_len, context_len + tl.minimum(tile_start + BLOCK_Q, q_len))
        for n_start in range(0, kv_end, BLOCK_N):
            n = n_start + tl.arange(0, BLOCK_N)
            n_valid = n < kv_end
            block = tl.load(block_table + b * stride_bt + n // PAGE, mask=n_valid, other=0).to(tl.int64)
            offset = n % PAGE
            k = tl.load(key_cache + block[:, None] * stride_kb + offset[:, None] * stride_ks
                        + kv_head * stride_kh + d[None, :], mask=n_valid[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            attend = (n[None, :] <= query_pos[:, None]) & n_valid[None, :]
            scores = tl.where(attend, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(value_cache + block[:, None] * stride_vb + offset[:, None] * stride_vs
                        + kv_head * stride_vh + d[None, :], mask=n_valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        result = acc / l_i[:, None]
        tl.store(out + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 result.to(out.dtype.element_ty), mask=row_valid[:, None])


def _check(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor) -> None:
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"the Triton attention kernel needs a power-of-two head_dim >= 16, got {head_dim}")
    if query.shape[1] % num_kv_heads:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {num_kv_heads} KV heads")
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1 or out.stride(2) != 1:
        raise ValueError("query, K/V caches and output need a contiguous last (head_dim) axis")
    if value_cache.shape != key_cache.shape or out.shape != query.shape:
        raise ValueError(f"shape mismatch: K {tuple(key_cache.shape)}, V {tuple(value_cache.shape)}, "
                         f"query {tuple(query.shape)}, out {tuple(out.shape)}")


def kernel_constants(group: int, head_dim: int, page: int, decode: bool, dtype: torch.dtype) -> dict[str, object]:
    """The kernel's compile-time parameters for one layout (also what an ahead-of-time compile needs)."""
    group_pad = triton.next_power_of_2(group)
    if decode:
        block_q, block_m = 1, max(_MIN_DOT_ROWS, group_pad)
    else:
        block_m = max(64 if head_dim <= 64 else 32, group_pad, _MIN_DOT_ROWS)
        block_q = block_m // group_pad
    return {"GROUP": group, "GROUP_PAD": group_pad, "BLOCK_Q": block_q, "BLOCK_M": block_m,
            "BLOCK_N": 64 if head_dim <= 64 else 32, "HEAD_DIM": head_dim, "PAGE": page, "DECODE": decode,
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"}  # tf32 only matters for fp32 inputs


def _launch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
            block_table: torch.Tensor, seq_lens: torch.Tensor, query_starts: torch.Tensor,
            query_lens: torch.Tensor, max_query_len: int, scale: float, decode: bool) -> None:
    _check(query, key_cache, value_cache, out)
    batch = block_table.shape[0]
    if batch == 0:
        return
    num_kv_heads, page, head_dim = key_cache.shape[2], key_cache.shape[1], key_cache.shape[3]
    constants = kernel_constants(query.shape[1] // num_kv_heads, head_dim, page, decode, query.dtype)
    grid = (batch, num_kv_heads, triton.cdiv(max_query_len, constants["BLOCK_Q"]))
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out, block_table, seq_lens, query_starts, query_lens, scale,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        out.stride(0), out.stride(1), block_table.stride(0), **constants)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor) -> None:
    """One query token per request: query/out [B, H, D], block_table [B, W], seq_lens [B] (incl. the token).

    The same signature as the C++ kernel's, so `DecodeGroup.kernel` takes either module.
    """
    _launch(query, key_cache, value_cache, out, block_table, seq_lens, seq_lens, seq_lens, 1, scale, True)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_table: torch.Tensor, query_starts: torch.Tensor, query_lens: torch.Tensor,
                            seq_lens: torch.Tensor, max_query_len: int, scale: float, out: torch.Tensor) -> None:
    """Prefill chunks over the paged cache (their own K/V already written to it): request i's queries are
    flat rows query_starts[i] .. + query_lens[i] of query/out [T, H, D]; its context is seq_lens[i] tokens.

    `max_query_len` (a host int, so no device read) sizes the grid.
    """
    _launch(query, key_cache, value_cache, out, block_table, seq_lens, query_starts, query_lens, max_query_len,
            scale, False)
