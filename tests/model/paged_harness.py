"""Drive a model through the paged KV cache by hand, without the scheduler: tests choose the batches."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenloop.model.attention import AttentionMetadata
from tokenloop.model.llama import LlamaModel


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
        self.kv = model.allocate_kv_cache(num_blocks, block_size)
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
        meta = AttentionMetadata.build(starts, seq_lens, table, torch.tensor(slots), self.block_size,
                                       self.model.decode_kernel, self.model.prefill_kernel)
        with torch.inference_mode():
            return self.model.forward(torch.tensor(ids), torch.tensor(positions), meta, self.kv,
                                      torch.tensor([s - 1 for s in starts[1:]]))
