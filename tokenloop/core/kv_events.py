"""KV cache events: what one engine's block pool tells a cluster router about its prefix index.

The shape follows vLLM's and llm-d's: `BlockStored` when full blocks enter the index, `BlockRemoved` when
cached hashes are evicted, `AllBlocksCleared` when the prefix cache is reset. Block hashes are the pool's
own chained SHA-256 hashes (`kv_cache.hash_block`), identical in every process, so a router can hash a
prompt itself and compare.

Producer side, inside one engine: the pool `record`s events into a `KVEventLog`; the engine `flush`es
once per step into a `KVEventBatch` with the next sequence number and publishes it. The log keeps the
last batches in a ring buffer so a consumer that missed some can replay them (`since`), and makes a
`KVIndexSnapshot` of the full index for one that fell further behind.

Consumer side: a `KVIndexMirror` per engine applies batches in sequence order, notices gaps, and
answers "how many leading blocks of this prompt does that engine hold?".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice


@dataclass(slots=True)
class BlockStored:
    """Consecutive full blocks of one sequence entered the index.

    `token_ids` are the blocks' tokens concatenated (`block_size` per block); `parent_block_hash` is the
    hash of the block before the first one, None when the first block starts its sequence. `group` is the
    KV group whose layers the blocks hold (docs/kv-groups.md): 0, the full group, for a one-group model.
    `lora_name`: the LoRA adapter whose K/V the blocks hold (vLLM's `lora_id`); None: the base model. The
    hashes already differ by adapter (its name is in the salt): the name tells a consumer whose they are.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    group: int = 0
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Cached hashes of one KV group left the index: their blocks were taken for new tokens."""

    block_hashes: list[int]
    group: int = 0


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: no hash is cached any more."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """The events of one engine step, in order; `seq` counts non-empty batches from 0 per engine."""

    seq: int
    ts_ns: int
    events: list[KVEvent]


@dataclass(slots=True)
class KVIndexSnapshot:
    """The whole index of one engine, current as of batch `seq` (-1: before any batch).

    A consumer that resyncs from it applies the batches with sequence > `seq`. Events recorded but not
    yet flushed when it was taken are already in it too and come again in batch `seq + 1`; applying them
    twice is harmless, since every event sets membership outright (stored: present, removed: absent).
    """

    seq: int
    ts_ns: int
    events: list[BlockStored] = field(default_factory=list)


class KVEventLog:
    """The producer side inside one engine: pending events, sequence numbers and a replay buffer.

    Not thread-safe: the engine core's loop records and flushes; publishing the batches elsewhere is
    its business. The batches' events are shared with the pool (a snapshot reads cached blocks' tokens
    from the `BlockStored` that announced them): consumers in the same process must not modify them.
    """

    def __init__(self, max_batches: int = 4096) -> None:
        if max_batches <= 0:
            raise ValueError(f"max_batches must be > 0, got {max_batches}")
        self.max_batches = max_batches
        self._pending: list[KVEvent] = []
        self._batches: deque[KVEventBatch] = deque(maxlen=max_batches)
        self._next_seq = 0

    @property
    def next_seq(self) -> int:
        """The sequence number the next non-empty `flush` will carry."""
        return self._next_seq

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def record(self, event: KVEvent) -> None:
        """Queue an event for the current batch."""
        self._pending.append(event)

    def flush(self, ts_ns: int) -> KVEventBatch | None:
        """Close the current batch and keep it for replay; None (and no sequence used) if it is empty."""
        if not self._pending:
            return None
        batch = KVEventBatch(self._next_seq, ts_ns, self._pending)
        self._pending = []
        self._next_seq += 1
        self._batches.append(batch)
        return batch

    def since(self, seq: int) -> list[KVEventBatch] | None:
        """The kept batches with sequence >= `seq`, oldest first.

        None when the consumer cannot catch up by replay and must resync from a `snapshot`: some of those
        batches already fell out of the buffer, or `seq` is beyond anything this log issued (the consumer
        followed an earlier incarnation of this engine).
        """
        if seq < 0:
            raise ValueError(f"seq must be >= 0, got {seq}")
        if seq > self._next_seq:
            return None
        if seq == self._next_seq:
            return []
        oldest = self._batches[0].seq if self._batches else self._next_seq
        if seq < oldest:
            return None
        return list(islice(self._batches, seq - oldest, None))

    def snapshot(self, indexed: Iterable[tuple[int, int, BlockStored | None, int]],
                 ts_ns: int = 0) -> KVIndexSnapshot:
        """The pool's whole index as `BlockStored` events, current as of the last flushed batch.

        `indexed` is the pool's index in publication order: each block's (hash, group, the `BlockStored`
        that announced it, its position there); `BlockPool.index_snapshot` passes it. Blocks are grouped
        into one event per run of consecutively published blocks of one chain, so a snapshot is about as
        compact as the events that built it.
        """
        events: list[BlockStored] = []
        last: BlockStored | None = None
        for block_hash, group, stored, pos in indexed:
            assert stored is not None, "a block indexed while a log is attached knows its BlockStored"
            size = stored.block_size
            tokens = stored.token_ids[pos * size:(pos + 1) * size]
            parent = stored.block_hashes[pos - 1] if pos else stored.parent_block_hash
            if (last is not None and last.block_hashes[-1] == parent and last.block_size == size
                    and last.group == group):
                last.block_hashes.append(block_hash)
                last.token_ids.extend(tokens)
                continue
            last = BlockStored([block_hash], parent, tokens, size, group)
            events.append(last)
        return KVIndexSnapshot(self._next_seq - 1, ts_ns, events)


class KVIndexMirror:
    """The consumer side: one engine's set of cached block hashes of group 0, rebuilt from its batches.

    Group 0 is the full group: a prefix it holds is what a router can score (a sliding group's blocks
    serve a hit only with the full group's, docs/kv-groups.md), so other groups' events are skipped.

    Batches must come in sequence order. An older or repeated batch is ignored; a newer one than expected
    means some were missed: the mirror refuses it and marks itself `stale` until the missing batch
    arrives (replayed with `KVEventLog.since(next_seq)`) or it `resync`s from a snapshot. A stale mirror
    still answers lookups, from the state it had; the caller decides how far to trust it.
    """

    def __init__(self) -> None:
        self._hashes: set[int] = set()
        self._next_seq = 0
        self.stale = False

    @property
    def hashes(self) -> set[int]:
        """The block hashes the engine holds (live view: do not modify)."""
        return self._hashes

    @property
    def next_seq(self) -> int:
        """The sequence number of the next batch this mirror can apply."""
        return self._next_seq

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply the next batch; False (and stale) if batches between were missed."""
        if batch.seq < self._next_seq:
            return True  # a duplicate: already in the state
        if batch.seq > self._next_seq:
            self.stale = True
            return False
        self._apply_events(batch.events)
        self._next_seq = batch.seq + 1
        self.stale = False
        return True

    def resync(self, snapshot: KVIndexSnapshot) -> None:
        """Replace the whole state with a snapshot's; then apply the batches after `snapshot.seq`."""
        self._hashes = set()
        self._apply_events(snapshot.events)
        self._next_seq = snapshot.seq + 1
        self.stale = False

    def longest_prefix(self, block_hashes: Sequence[int]) -> int:
        """How many leading hashes of a chain the engine holds (a prefix hit needs the whole chain)."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._hashes:
                break
            count += 1
        return count

    def _apply_events(self, events: Sequence[KVEvent]) -> None:
        hashes = self._hashes
        for event in events:
            if isinstance(event, (BlockStored, BlockRemoved)) and event.group != 0:
                continue
            if isinstance(event, BlockStored):
                hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                # discard, not remove: an event replayed over a snapshot that already reflects it
                hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                hashes.clear()
            else:
                raise TypeError(f"not a KV event: {event!r}")


# ---- wire form: plain nested lists, for msgpack or JSON -------------------------------------------

def batch_to_wire(batch: KVEventBatch) -> list:
    """`[seq, ts_ns, [[tag, *fields], ...]]`: positional, like msgspec's array_like tagged structs. A
    group other than 0 is one more field at the end (a one-group engine's wire form is as it always was)."""
    events: list[list] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            tail = [event.group, event.lora_name] if event.lora_name is not None else \
                [event.group] if event.group else []
            events.append(["stored", event.block_hashes, event.parent_block_hash, event.token_ids,
                           event.block_size, *tail])
        elif isinstance(event, BlockRemoved):
            events.append(["removed", event.block_hashes, *([event.group] if event.group else [])])
        else:
            events.append(["cleared"])
    return [batch.seq, batch.ts_ns, events]


def batch_from_wire(data: Sequence) -> KVEventBatch:
    """Inverse of `batch_to_wire`; raises ValueError on an unknown event tag."""
    seq, ts_ns, raw_events = data
    events: list[KVEvent] = []
    for raw in raw_events:
        tag = raw[0]
        if tag == "stored":
            events.append(BlockStored(list(raw[1]), raw[2], list(raw[3]), raw[4], raw[5] if len(raw) > 5 else 0,
                                      raw[6] if len(raw) > 6 else None))
        elif tag == "removed":
            events.append(BlockRemoved(list(raw[1]), raw[2] if len(raw) > 2 else 0))
        elif tag == "cleared":
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV event tag {tag!r}")
    return KVEventBatch(seq, ts_ns, events)
