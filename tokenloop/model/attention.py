"""Paged attention: write new K/V at their slots, attend over each request's block table.

The KV cache of one layer is a pair of tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.
A slot is `block_id * block_size + offset`. Everything that depends only on the step (which slots to
read, masks, which requests decode) is built once in `AttentionMetadata.build` and reused by every
layer; a layer only gathers and multiplies.

Requests with one query token (decode) are attended together as one padded batch; requests with
several (prefill chunks) are attended one by one, since padding a 512-token chunk next to 31 decodes
would multiply the work. That gather + SDPA path is the reference. Kernels that read K/V in place through
the block table replace it where they exist: the C++ decode kernel on the CPU (`cpu_kernels.py`), and on
CUDA the Triton kernel (`triton_attention.py`) for decode rows and, in one launch, all prefill chunks.

Building the metadata reads nothing back from the device: lengths come from the host tensors the runner
passes, and only index tensors travel to the device.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


@dataclass
class DecodeGroup:
    """Requests with exactly one new token this step, attended together.

    With the C++ kernel, it reads K/V in place through `block_table`; otherwise the blocks are gathered
    into one padded batch for SDPA (`block_index`, `mask`).
    """

    token_index: torch.Tensor  # [Bd] positions of their query tokens in the flat batch
    block_table: torch.Tensor  # [Bd, max_blocks] int64, contiguous
    seq_lens: torch.Tensor  # [Bd] int64
    kernel: ModuleType | None  # the compiled decode-attention module, when available
    block_index: torch.Tensor | None = None  # [Bd, max_blocks] block ids to gather (padding repeats a valid block)
    mask: torch.Tensor | None = None  # [Bd, 1, 1, max_blocks * block_size] bool: True where the key is attended


@dataclass
class PrefillSpan:
    """One request with several new tokens: a prefill chunk, or a prompt continuing after a prefix hit."""

    token_start: int
    token_end: int
    context_slots: torch.Tensor | None  # [seq_len] slots to read; None when the context is only this step's tokens
    mask: torch.Tensor | None  # [q_len, seq_len] bool, causal bottom-right (and windowed); None: plain causal


@dataclass
class PrefillGroup:
    """All prefill chunks of a step for a kernel that reads the paged cache in place (the Triton kernel)."""

    block_table: torch.Tensor  # [Bp, max_blocks]
    query_starts: torch.Tensor  # [Bp] int64: each chunk's first row in the flat batch
    query_lens: torch.Tensor  # [Bp] int64
    seq_lens: torch.Tensor  # [Bp] int64: context after this step, the chunk included
    max_query_len: int  # a host number: sizes the launch grid without a device read
    kernel: ModuleType  # has paged_prefill_attention


@dataclass
class AttentionMetadata:
    """The flat batch's attention layout, shared by every layer of one forward."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    query_start_loc: list[int]  # [B+1]
    seq_lens: list[int]  # [B] context length after this step, per request
    block_table: torch.Tensor  # [B, max_blocks]
    block_size: int
    decode: DecodeGroup | None
    prefills: list[PrefillSpan]
    prefill_group: PrefillGroup | None = None  # set instead of `prefills` when a prefill kernel runs them
    window: int = 0  # keys a query sees, itself included (0: its whole context)

    @classmethod
    def build(
        cls,
        query_start_loc: list[int] | torch.Tensor,
        seq_lens: list[int] | torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        decode_kernel: ModuleType | None = None,
        prefill_kernel: ModuleType | None = None,
        window: int = 0,
    ) -> AttentionMetadata:
        """The layout from the step's flat tensors; `query_start_loc` [B+1] and `seq_lens` [B] may be int64
        host tensors (the runner's, built over the batch at once) or lists. With a `window` (a sliding KV
        group's, docs/kv-groups.md), each query sees only the `window` latest keys up to itself, and reads
        only the blocks from the one holding the first key it sees: blocks before it may be released (id -1 in
        the table) and are never read. Decode rows keep a kernel that takes a window (the C++ one says so by
        `decode_attention_window`); the others run through masks."""
        if window > 0:
            prefill_kernel = None
            if not getattr(decode_kernel, "decode_attention_window", False):
                decode_kernel = None
        device = slot_mapping.device
        starts = torch.as_tensor(query_start_loc, dtype=torch.long)
        lens_all = torch.as_tensor(seq_lens, dtype=torch.long)
        if starts.device.type != "cpu" or lens_all.device.type != "cpu":
            raise ValueError("query_start_loc and seq_lens must be host tensors or lists (read without a sync)")
        starts_list, lens_list = starts.tolist(), lens_all.tolist()
        # A decode step (every row one token, the common case) needs no row selection: it is every row.
        all_decode = starts_list == list(range(len(starts_list))) and len(starts_list) > 1
        query_lens = None if all_decode else starts[1:] - starts[:-1]
        decode_rows = None if query_lens is None else torch.nonzero(query_lens == 1).squeeze(1)
        decode = None
        if decode_rows is None or decode_rows.numel():
            decode = _decode_group(starts, lens_all, lens_list, decode_rows, block_table, block_size, decode_kernel,
                                   window, device)

        if query_lens is None:  # every row decodes: no prefill
            return cls(slot_mapping, starts_list, lens_list, block_table, block_size, decode, [], None, window)
        prefill_rows = torch.nonzero(query_lens > 1).squeeze(1)
        if prefill_kernel is not None and prefill_rows.numel():
            group = PrefillGroup(
                block_table=block_table.index_select(0, prefill_rows.to(device)).contiguous(),
                query_starts=starts[prefill_rows].to(device), query_lens=query_lens[prefill_rows].to(device),
                seq_lens=lens_all[prefill_rows].to(device), max_query_len=int(query_lens[prefill_rows].max()),
                kernel=prefill_kernel)
            return cls(slot_mapping, starts_list, lens_list, block_table, block_size, decode, [], group,
                       window)
        prefills = _prefill_spans(prefill_rows.tolist(), starts_list, lens_list, block_table, block_size, window,
                                  device)
        return cls(slot_mapping, starts_list, lens_list, block_table, block_size, decode, prefills, None,
                   window)


def _decode_group(starts: torch.Tensor, lens_all: torch.Tensor, lens_list: list[int], decode_rows: torch.Tensor | None,
                  block_table: torch.Tensor, block_size: int, decode_kernel: ModuleType | None, window: int,
                  device: torch.device) -> DecodeGroup:
    """The step's one-token rows (`decode_rows`; None: every row) as a `DecodeGroup`: their block tables
    for the kernel, or the gather indices and masks for SDPA without one."""
    host_lens = lens_all if decode_rows is None else lens_all[decode_rows]
    lens = host_lens.to(device)
    max_len = max(lens_list) if decode_rows is None else int(host_lens.max())
    max_blocks = (max_len + block_size - 1) // block_size
    blocks = (block_table if decode_rows is None
              else block_table.index_select(0, decode_rows.to(device)))[:, :max_blocks]
    blocks = blocks.to(torch.long).contiguous()
    token_index = (starts[:-1] if decode_rows is None else starts[decode_rows]).to(device)
    decode = DecodeGroup(token_index=token_index, block_table=blocks, seq_lens=lens, kernel=decode_kernel)
    if decode_kernel is None:
        valid_blocks = (lens + block_size - 1) // block_size
        block_pos = torch.arange(max_blocks, device=device)[None, :]
        picked = blocks
        if window > 0:  # gather only the window's blocks: from the one holding its first key
            span = min(max_blocks, (window - 1) // block_size + 2)
            block_pos = ((lens - window).clamp(min=0) // block_size)[:, None] + block_pos[:, :span]
            picked = blocks.gather(1, block_pos.clamp(max=max_blocks - 1))
        # Padding entries past a request's last block may hold garbage ids: point them at the first
        # block gathered (a window's first: blocks before it may be released, id -1, never read).
        decode.block_index = torch.where(block_pos < valid_blocks[:, None], picked, picked[:, :1])
        offsets = torch.arange(block_size, device=device)
        key_pos = (block_pos[..., None] * block_size + offsets).flatten(-2)
        visible = key_pos < lens[:, None]
        if window > 0:
            visible &= key_pos >= lens[:, None] - window
        decode.mask = visible[:, None, None, :]
    return decode


def _prefill_spans(rows: list[int], starts_list: list[int], lens_list: list[int], block_table: torch.Tensor,
                   block_size: int, window: int, device: torch.device) -> list[PrefillSpan]:
    """The step's prefill chunks, each with the slots of its context and its mask where it needs them."""
    prefills: list[PrefillSpan] = []
    for row in rows:  # prefill chunks are few per step
        start, seq_len = starts_list[row], lens_list[row]
        q_len = starts_list[row + 1] - start
        fresh = seq_len == q_len  # nothing cached before this chunk: attend over the new K/V directly
        if fresh and not 0 < window < q_len:
            prefills.append(PrefillSpan(start, start + q_len, None, None))
            continue
        # A windowed chunk reads from the first key its first query sees.
        first_key = max(0, seq_len - q_len - window + 1) if window > 0 and not fresh else 0
        positions = torch.arange(first_key, seq_len, device=device)
        slots = None if fresh else \
            block_table[row, positions // block_size] * block_size + positions % block_size
        query_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        mask = positions[None, :] <= query_pos[:, None]
        if window > 0:
            mask &= positions[None, :] > query_pos[:, None] - window
        prefills.append(PrefillSpan(start, start + q_len, slots, mask))
    return prefills


def triton_attention_kernels() -> ModuleType | None:
    """The Triton kernel module (`triton_attention`), or None without triton or with TOKENLOOP_TRITON=0."""
    if os.environ.get("TOKENLOOP_TRITON", "1") == "0":
        return None
    try:
        return importlib.import_module("tokenloop.model.triton_attention")
    except ImportError as exc:
        logger.warning("Triton attention unavailable (%s); using gather + SDPA", exc)
        return None


def write_kv(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's K/V ([T, KVH, D]) at their slots, in the cache's dtype (rounded for a bf16 cache)."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_written: bool = False,
) -> torch.Tensor:
    """Write K/V (unless a fused kernel already has), then attend.
    query [T, H, D], key/value [T, KVH, D] -> output [T, H, D]. A cache in another dtype than the query
    (bf16 K/V, fp32 activations) is widened as it is read; this step's own K/V are attended as cached."""
    if not kv_written:
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
    output = torch.empty_like(query)
    _attend_decodes(query, key_cache, value_cache, meta, scale, output, num_kv_heads=key.shape[1])
    _attend_prefills(query, key, value, key_cache, value_cache, meta, scale, output)
    return output


def _attend_decodes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, output: torch.Tensor, num_kv_heads: int) -> None:
    """The decode rows' attention into `output`: the kernel reading the cache in place, or gather + SDPA."""
    num_tokens, num_heads, head_dim = query.shape
    group = num_heads // num_kv_heads
    if meta.decode is not None and meta.decode.kernel is not None:
        d, kernel = meta.decode, meta.decode.kernel
        window = (meta.window,) if meta.window > 0 else ()  # only a kernel that takes a window gets one (build)
        if d.token_index.shape[0] == num_tokens:  # a pure decode step: the rows are the batch, in order
            kernel.paged_decode_attention(query.contiguous(), key_cache, value_cache, d.block_table, d.seq_lens,
                                          scale, output, *window)
        else:
            q = query.index_select(0, d.token_index)
            attended = torch.empty_like(q)
            kernel.paged_decode_attention(q, key_cache, value_cache, d.block_table, d.seq_lens, scale, attended,
                                          *window)
            output.index_copy_(0, d.token_index, attended)
    elif meta.decode is not None:
        d = meta.decode
        assert d.block_index is not None and d.mask is not None
        batch, max_blocks = d.block_index.shape
        context = max_blocks * meta.block_size
        # [Bd, max_blocks, bs, KVH, D] -> [Bd, KVH, S, D]; whole blocks are gathered, not single slots.
        block_ids = d.block_index.view(-1)  # index_select copies whole blocks; advanced indexing is ~10x slower
        keys = key_cache.index_select(0, block_ids).to(query.dtype)
        values = value_cache.index_select(0, block_ids).to(query.dtype)
        keys = keys.view(batch, context, num_kv_heads, head_dim).transpose(1, 2)
        values = values.view(batch, context, num_kv_heads, head_dim).transpose(1, 2)
        # Heads sharing a KV head become that head's query rows: no K/V repeat for GQA.
        q = query.index_select(0, d.token_index).view(batch, num_kv_heads, group, head_dim)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=d.mask, scale=scale)
        output.index_copy_(0, d.token_index, attended.reshape(batch, num_heads, head_dim))


def _attend_prefills(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, meta: AttentionMetadata, scale: float, output: torch.Tensor) -> None:
    """The prefill chunks' attention into `output`: the kernel over all of them, or SDPA chunk by chunk."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    if meta.prefill_group is not None:
        p = meta.prefill_group
        p.kernel.paged_prefill_attention(query, key_cache, value_cache, p.block_table, p.query_starts,
                                         p.query_lens, p.seq_lens, p.max_query_len, scale, output)
    flat_keys = key_cache.view(-1, num_kv_heads, head_dim)
    flat_values = value_cache.view(-1, num_kv_heads, head_dim)
    for span in meta.prefills:
        q = query[span.token_start:span.token_end].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
        if span.context_slots is None:  # rounded as cached: the same values a later chunk will read
            k = key[span.token_start:span.token_end].to(key_cache.dtype).to(query.dtype)
            v = value[span.token_start:span.token_end].to(value_cache.dtype).to(query.dtype)
        else:
            k = flat_keys.index_select(0, span.context_slots).to(query.dtype)
            v = flat_values.index_select(0, span.context_slots).to(query.dtype)
        k = k.transpose(0, 1).unsqueeze(0)
        v = v.transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(
            q, k, v, attn_mask=span.mask, is_causal=span.mask is None, scale=scale, enable_gqa=group > 1)
        output[span.token_start:span.token_end] = attended.squeeze(0).transpose(0, 1)


def dense_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Reference attention for one whole sequence: query [L, H, D], key/value [L, KVH, D].

    Plain math with explicit head repetition; tests compare the paged path against it.
    """
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, k) * scale
    length = query.shape[0]
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
