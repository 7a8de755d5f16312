"""The physical KV blocks: refcounts, the free LRU queue and the prefix index, one pool for every KV group.

A block is either referenced (refcount > 0, held by block tables) or free (refcount 0, sitting in the free
queue). A free block may still carry the hash of the tokens whose K/V it holds, so a later request with the
same prefix can take it back out of the free queue (a prefix hit); its hash is evicted only when the block
is taken for new tokens. Which request holds which block is `core/kv_cache.py`'s state, not the pool's.

With a `KVEventLog` attached, the pool records what happens to its index as KV events (`kv_events.py`):
blocks stored, hashes evicted, the whole cache cleared. Without one, the hot path pays one `is None` check.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from tokenloop.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog, KVIndexSnapshot


@dataclass(eq=False)
class KVBlock:
    """One physical block of `block_size` token slots.

    `prev_free`/`next_free` link the block into the free queue; both are None while it is referenced.
    `stored_event` is the `BlockStored` that announced the indexed block (at `stored_pos` in it), kept only
    while the pool has an event log, so that a snapshot can describe the block again.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    group: int = 0  # the KV group whose layers it holds while taken (docs/kv-groups.md); indexed under it
    stored_event: BlockStored | None = field(default=None, repr=False)
    stored_pos: int = field(default=0, repr=False)
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)

    @property
    def in_free_queue(self) -> bool:
        return self.prev_free is not None


class FreeBlockQueue:
    """Free blocks in eviction order (front = taken next), as an intrusive doubly linked list.

    Every operation is O(1), including removing a block from the middle when a prefix hit revives it.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        # Sentinels spare every operation the empty-list and end-of-list special cases.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def _insert_between(self, block: KVBlock, before: KVBlock, after: KVBlock) -> None:
        if block.in_free_queue:
            raise RuntimeError(f"block {block.block_id} is already in the free queue")
        block.prev_free, block.next_free = before, after
        before.next_free = block
        after.prev_free = block
        self._len += 1

    def append(self, block: KVBlock) -> None:
        """Put a block at the back: evicted last."""
        assert self._tail.prev_free is not None
        self._insert_between(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        """Put a block at the front: taken first."""
        assert self._head.next_free is not None
        self._insert_between(block, self._head, self._head.next_free)

    def remove(self, block: KVBlock) -> None:
        """Unlink a block from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVBlock:
        """Take the block at the front."""
        block = self._head.next_free
        if block is None or block is self._tail:
            raise RuntimeError("the free queue is empty")
        self.remove(block)
        return block


class BlockPool:
    """All physical blocks, their refcounts, the free LRU queue and the (group, hash) -> block prefix index.

    The index and the blocks' `block_hash` fields mirror each other exactly: a block carries a hash iff
    its group's index maps that hash to it. Every KV group draws from the one free queue; a block taken
    for group g holds g's layers, so the index keeps one hash -> block map per group. When two requests
    compute the same block independently, only the first copy is indexed; the second stays anonymous and
    is recycled first once free.

    `events`, when given, receives a `BlockStored` per run of blocks published together, a `BlockRemoved`
    per `take` that evicts hashes and an `AllBlocksCleared` per prefix-cache reset.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 events: KVEventLog | None = None, num_groups: int = 1) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._indexes: list[dict[int, KVBlock]] = [{} for _ in range(num_groups)]
        self.evictions = 0  # cached hashes dropped because their block was taken for new tokens
        self.num_cached_free = 0  # free blocks that still carry a hash: reusable by a prefix hit
        self.events = events

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached(self) -> int:
        """Blocks carrying a hash (referenced or free), over every group."""
        return sum(len(index) for index in self._indexes)

    def lookup(self, block_hash: int, group: int = 0) -> KVBlock | None:
        return self._indexes[group].get(block_hash)

    def cached_items(self, group: int | None = None) -> list[tuple[int, KVBlock]]:
        """The prefix index as (hash, block) pairs, of one group or of all (group 0 first); for inspection,
        snapshots and tests."""
        indexes = self._indexes if group is None else [self._indexes[group]]
        return [item for index in indexes for item in index.items()]

    def index_snapshot(self, ts_ns: int = 0) -> KVIndexSnapshot:
        """The whole prefix index as `BlockStored` events (`KVEventLog.snapshot`): what a consumer that
        lost events resyncs from. Needs the event log this pool records to (ValueError without one)."""
        if self.events is None:
            raise ValueError("an index snapshot needs the pool's event log: only it knows the blocks' tokens")
        return self.events.snapshot(((block_hash, block.group, block.stored_event, block.stored_pos)
                                     for block_hash, block in self.cached_items()), ts_ns)

    def take(self, n: int, group: int = 0) -> list[KVBlock]:
        """Take `n` blocks from the front of the free queue for `group`, each with refcount 1.

        A taken block that still carried a hash loses it now (lazy eviction), whichever group it held.
        """
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks but only {self.num_free} are free")
        taken: list[KVBlock] = []
        removed: dict[int, list[int]] | None = None if self.events is None else {}
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                if removed is not None:
                    removed.setdefault(block.group, []).append(block.block_hash)
                    block.stored_event = None
                self.num_cached_free -= 1
                del self._indexes[block.group][block.block_hash]
                block.block_hash = None
                self.evictions += 1
            block.ref_cnt = 1
            block.group = group
            taken.append(block)
        if removed:
            assert self.events is not None
            for evicted_group, hashes in sorted(removed.items()):
                self.events.record(BlockRemoved(hashes, evicted_group))
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each block, pulling free ones out of the free queue (prefix hits)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_cnt += 1

    def publish(self, block: KVBlock, block_hash: int) -> bool:
        """Index a block that has just become full under `block_hash` in its group; False if not indexed."""
        index = self._indexes[block.group]
        if not self.enable_caching or block.block_hash is not None or block_hash in index or block.block_id < 0:
            return False
        block.block_hash = block_hash
        index[block_hash] = block
        return True

    def publish_recorded(self, blocks: Sequence[KVBlock], block_hashes: Sequence[int], start: int, end: int,
                         token_ids: Sequence[int], block_size: int, lora_name: str | None = None) -> None:
        """`publish` blocks[start:end] under block_hashes[start:end] and record what was indexed.

        `blocks`, `block_hashes` and `token_ids` are one sequence's table, chain and tokens. Each run of
        consecutive blocks that got indexed becomes one `BlockStored`; a block whose hash was already
        indexed (the same content computed twice) is not new to the index, so it records nothing and
        splits the run.
        """
        events = self.events
        if events is None:
            raise RuntimeError("publish_recorded needs an event log")
        run_start = -1
        for i in range(start, end + 1):
            if i < end and self.publish(blocks[i], block_hashes[i]):
                if run_start < 0:
                    run_start = i
            elif run_start >= 0:
                parent = block_hashes[run_start - 1] if run_start else None
                event = BlockStored(list(block_hashes[run_start:i]), parent,
                                    list(token_ids[run_start * block_size:i * block_size]), block_size,
                                    blocks[run_start].group, lora_name)
                events.record(event)
                # The blocks point into their event instead of copying their tokens: no list per block,
                # which would cost more in allocation and garbage collection than the event itself.
                for pos, j in enumerate(range(run_start, i)):
                    block = blocks[j]
                    block.stored_event = event
                    block.stored_pos = pos
                run_start = -1

    def publish_one(self, block: KVBlock, block_hash: int, parent_hash: int | None,
                    token_ids: Sequence[int], block_size: int, lora_name: str | None = None) -> bool:
        """`publish` one block that came from elsewhere (a handoff's copy), recording it as stored."""
        if not self.publish(block, block_hash):
            return False
        if self.events is not None:
            event = BlockStored([block_hash], parent_hash, list(token_ids), block_size, block.group, lora_name)
            self.events.record(event)
            block.stored_event, block.stored_pos = event, 0
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash, as vLLM does; refused (False) while any block is referenced.

        A request holding blocks has offered them to the index once and never offers them again, so a
        reset under it could not be undone by its later steps; an idle pool has no such request. Records
        `AllBlocksCleared` when it succeeds.
        """
        if self.num_free != self.num_blocks:
            return False
        for index in self._indexes:
            for block in index.values():
                block.block_hash = None
                block.stored_event = None
            index.clear()
        self.num_cached_free = 0
        if self.events is not None:
            self.events.record(AllBlocksCleared())
        return True

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order given.

        A block reaching refcount 0 keeps its hash and joins the back of the queue (evicted last, so
        it stays reusable longest); an anonymous block joins the front (it is worth nothing, reuse it first).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_queue.append(block)
                    self.num_cached_free += 1
                else:
                    self.free_queue.appendleft(block)

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's own state is inconsistent."""
        seen: set[int] = set()
        prev = self.free_queue._head
        for block in self.free_queue:
            check_invariant(block.prev_free is prev, f"broken free-queue link before block {block.block_id}")
            check_invariant(block.block_id not in seen, f"block {block.block_id} is twice in the free queue")
            check_invariant(block.ref_cnt == 0, f"block {block.block_id} is free with refcount {block.ref_cnt}")
            seen.add(block.block_id)
            prev = block
        check_invariant(len(seen) == len(self.free_queue), "free-queue length disagrees with its links")
        for block in self.blocks:
            check_invariant(block.ref_cnt >= 0, f"block {block.block_id} has refcount {block.ref_cnt}")
            # Exactly one state: free (in the queue, refcount 0) or referenced (refcount > 0, not queued).
            check_invariant((block.ref_cnt == 0) == (block.block_id in seen) == block.in_free_queue,
                   f"block {block.block_id} is in no state or two (refcount {block.ref_cnt})")
            if block.block_hash is not None:
                check_invariant(self._indexes[block.group].get(block.block_hash) is block,
                       f"block {block.block_id} carries a hash its group's index does not map to it")
        referenced = sum(1 for block in self.blocks if block.ref_cnt > 0)
        check_invariant(len(seen) + referenced == self.num_blocks,
               f"free ({len(seen)}) + referenced ({referenced}) != total ({self.num_blocks})")
        for group, index in enumerate(self._indexes):
            for block_hash, block in index.items():
                check_invariant(block.block_hash == block_hash and block.group == group,
                       f"cached hash {block_hash:#x} of group {group} resolves to a block without it")
        cached_free = sum(1 for block in self.blocks if block.ref_cnt == 0 and block.block_hash is not None)
        check_invariant(cached_free == self.num_cached_free,
               f"num_cached_free is {self.num_cached_free} but {cached_free} free blocks carry a hash")


def check_invariant(condition: bool, message: str) -> None:
    """Raise AssertionError with `message` unless `condition` holds (an invariant check of the KV state)."""
    # Not `assert`: the checks must still run under `python -O`.
    if not condition:
        raise AssertionError(message)
