"""Drive a model through the paged KV cache by hand, without the scheduler: tests choose the batches."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from tokenloop.model.attention import AttentionMetadata
from tokenloop.model.models.llama import LlamaModel


@dataclass
class Sequence:
    token_ids: list[int]
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0


class PagedHarness:
    """Allocates blocks in a scrambled order and runs mixed batches of (sequence, n new tokens)."""

    def __init__(self, model: LlamaModel, num_blocks: int = 256, block_size: int = 16) -> None:
        self.model = model
        self.block_size = block_size
        # A model with several KV groups: group g's copy of block b is block b + g * num_blocks of the pool.
        self.groups = model.kv_groups()
        self.num_blocks = num_blocks
        self.kv = model.allocate_kv_cache(num_blocks * len(self.groups), block_size)
        self.free = list(range(num_blocks))[::-1]  # scrambled relative to sequence order on purpose
        self.free = self.free[1::2] + self.free[0::2]

    def share_prefix(self, source: Sequence, target: Sequence, num_blocks: int) -> None:
        """Point target's first blocks at source's (a prefix-cache hit) and skip computing them."""
        assert target.token_ids[:num_blocks * self.block_size] == source.token_ids[:num_blocks * self.block_size]
        target.blocks = source.blocks[:num_blocks]
        target.num_computed = num_blocks * self.block_size

    def step(self, work: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Compute `n` more tokens for each sequence in one flat batch; logits of each one's last token."""
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq, n in work:
            end = seq.num_computed + n
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free.pop())
            for pos in range(seq.num_computed, end):
                ids.append(seq.token_ids[pos])
                positions.append(pos)
                slots.append(seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            starts.append(starts[-1] + n)
            seq_lens.append(end)
            seq.num_computed = end
        width = max(len(seq.blocks) for seq, _ in work)
        table = torch.tensor([seq.blocks + [0] * (width - len(seq.blocks)) for seq, _ in work])
        slot_tensor = torch.tensor(slots, dtype=torch.long)
        metas = [AttentionMetadata.build(starts, seq_lens, table + g * self.num_blocks,
                                         slot_tensor + g * self.num_blocks * self.block_size, self.block_size,
                                         self.model.decode_kernel, self.model.prefill_kernel,
                                         window=group.window if group.kind == "sliding" else 0)
                 for g, group in enumerate(self.groups)]
        meta = metas[0] if len(metas) == 1 else metas
        with torch.inference_mode():
            return self.model.forward(torch.tensor(ids), torch.tensor(positions), meta, self.kv,
                                      torch.tensor([s - 1 for s in starts[1:]]))


@dataclass
class PagedStep:
    """One step's attention inputs: requests' (cached context, new tokens) over scattered blocks."""

    starts: list[int]  # query_start_loc
    seq_lens: list[int]
    block_table: torch.Tensor
    slots: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor  # stale random K/V everywhere this step does not write: it must not leak in
    value_cache: torch.Tensor


def random_paged_step(lengths: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                      block_size: int, dtype: torch.dtype, device: str, seed: int) -> PagedStep:
    """Blocks shuffled over a pool a little larger than needed; the table has one spare padding column."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    per_request = [(c + n + block_size - 1) // block_size for c, n in lengths]
    num_blocks = sum(per_request) + 5
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(k)] for k in per_request]
    width = max(per_request) + 1
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    starts, seq_lens, slots = [0], [], []
    for (context, new), table in zip(lengths, tables):
        positions = torch.arange(context, context + new)
        slots.append(torch.tensor(table)[positions // block_size] * block_size + positions % block_size)
        starts.append(starts[-1] + new)
        seq_lens.append(context + new)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=device).to(dtype)

    tokens = starts[-1]
    return PagedStep(starts, seq_lens, block_table, torch.cat(slots).to(device), randn(tokens, num_heads, head_dim),
                     randn(tokens, num_kv_heads, head_dim), randn(tokens, num_kv_heads, head_dim), randn(*shape),
                     randn(*shape))
