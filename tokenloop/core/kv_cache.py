"""The paged KV cache's bookkeeping: physical blocks, refcounts, the free LRU queue and the prefix index.

`BlockPool` owns the blocks. A block is either referenced (refcount > 0, held by block tables) or free
(refcount 0, sitting in the free queue). A free block may still carry the hash of the tokens whose K/V it
holds, so a later request with the same prefix can take it back out of the free queue (a prefix hit);
its hash is evicted only when the block is taken for new tokens.

`KVCacheManager` keeps one block table per request: `allocate` grows it for the tokens a step computes,
`get_computed_blocks` finds the longest cached prefix of a new or preempted request, `free` drops it.
Only bookkeeping lives here; the K/V tensors belong to the model runner, which addresses them by block id.

With a `KVEventLog` attached, the pool records what happens to its index as KV events (`kv_events.py`):
blocks stored, hashes evicted, the whole cache cleared. Without one, the hot path pays one `is None` check.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

from tokenloop.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog

if TYPE_CHECKING:  # only for annotations: keeps this module free of the torch import
    from tokenloop.request import Request


def hash_block(parent_hash: int | None, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
    """Chained hash of one full block: a stable 64-bit int, the same in every process and on every run.

    sha256 over a fixed-width little-endian encoding (no `hash()`: it is salted per process).
    """
    # A flag byte keeps "no parent" distinct from any parent value.
    parent = b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(8, "little")
    salt = cache_salt.encode("utf-8") if cache_salt else b""
    # Length-prefixed so that salt bytes can never be read as token bytes. One sha256 call over the joined
    # parts (the digest of feeding them one by one): every block of every request is hashed, so it is hot.
    data = parent + len(salt).to_bytes(4, "little") + salt + struct.pack(f"<{len(token_ids)}q", *token_ids)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def block_hash_chain(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                     parent_hash: int | None = None) -> list[int]:
    """The chained hashes of every full block of `token_ids` (after `parent_hash`), as the pool keys them."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start:start + block_size], cache_salt)
        hashes.append(parent_hash)
    return hashes


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
    """All physical blocks, their refcounts, the free LRU queue and the hash -> block prefix index.

    The index and the blocks' `block_hash` fields mirror each other exactly: a block carries a hash iff
    the index maps that hash to it. When two requests compute the same block independently, only the
    first copy is indexed; the second stays anonymous and is recycled first once free.

    `events`, when given, receives a `BlockStored` per run of blocks published together, a `BlockRemoved`
    per `take` that evicts hashes and an `AllBlocksCleared` per prefix-cache reset.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 events: KVEventLog | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._index: dict[int, KVBlock] = {}
        self.evictions = 0  # cached hashes dropped because their block was taken for new tokens
        self.num_cached_free = 0  # free blocks that still carry a hash: reusable by a prefix hit
        self.events = events

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached(self) -> int:
        """Blocks carrying a hash (referenced or free)."""
        return len(self._index)

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self._index.get(block_hash)

    def cached_items(self) -> list[tuple[int, KVBlock]]:
        """The prefix index as (hash, block) pairs; for inspection and tests."""
        return list(self._index.items())

    def take(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the front of the free queue, each with refcount 1.

        A taken block that still carried a hash loses it now (lazy eviction).
        """
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks but only {self.num_free} are free")
        taken: list[KVBlock] = []
        removed: list[int] | None = None if self.events is None else []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                if removed is not None:
                    removed.append(block.block_hash)
                    block.stored_event = None
                self.num_cached_free -= 1
                del self._index[block.block_hash]
                block.block_hash = None
                self.evictions += 1
            block.ref_cnt = 1
            taken.append(block)
        if removed:
            assert self.events is not None
            self.events.record(BlockRemoved(removed))
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
        """Index a block that has just become full under `block_hash`; False if not indexed."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._index:
            return False
        block.block_hash = block_hash
        self._index[block_hash] = block
        return True

    def publish_recorded(self, blocks: Sequence[KVBlock], block_hashes: Sequence[int], start: int, end: int,
                         token_ids: Sequence[int], block_size: int) -> None:
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
                event = BlockStored(block_hashes[run_start:i], parent,
                                    token_ids[run_start * block_size:i * block_size], block_size)
                events.record(event)
                # The blocks point into their event instead of copying their tokens: no list per block,
                # which would cost more in allocation and garbage collection than the event itself.
                for pos, j in enumerate(range(run_start, i)):
                    block = blocks[j]
                    block.stored_event = event
                    block.stored_pos = pos
                run_start = -1

    def publish_one(self, block: KVBlock, block_hash: int, parent_hash: int | None,
                    token_ids: Sequence[int], block_size: int) -> bool:
        """`publish` one block that came from elsewhere (a handoff's copy), recording it as stored."""
        if not self.publish(block, block_hash):
            return False
        if self.events is not None:
            event = BlockStored([block_hash], parent_hash, list(token_ids), block_size)
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
        for block in self._index.values():
            block.block_hash = None
            block.stored_event = None
        self._index.clear()
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
            _check(block.prev_free is prev, f"broken free-queue link before block {block.block_id}")
            _check(block.block_id not in seen, f"block {block.block_id} is twice in the free queue")
            _check(block.ref_cnt == 0, f"block {block.block_id} is free with refcount {block.ref_cnt}")
            seen.add(block.block_id)
            prev = block
        _check(len(seen) == len(self.free_queue), "free-queue length disagrees with its links")
        for block in self.blocks:
            _check(block.ref_cnt >= 0, f"block {block.block_id} has refcount {block.ref_cnt}")
            # Exactly one state: free (in the queue, refcount 0) or referenced (refcount > 0, not queued).
            _check((block.ref_cnt == 0) == (block.block_id in seen) == block.in_free_queue,
                   f"block {block.block_id} is in no state or two (refcount {block.ref_cnt})")
            if block.block_hash is not None:
                _check(self._index.get(block.block_hash) is block,
                       f"block {block.block_id} carries a hash the index does not map to it")
        referenced = sum(1 for block in self.blocks if block.ref_cnt > 0)
        _check(len(seen) + referenced == self.num_blocks,
               f"free ({len(seen)}) + referenced ({referenced}) != total ({self.num_blocks})")
        for block_hash, block in self._index.items():
            _check(block.block_hash == block_hash,
                   f"cached hash {block_hash:#x} resolves to a block without it")
        cached_free = sum(1 for block in self.blocks if block.ref_cnt == 0 and block.block_hash is not None)
        _check(cached_free == self.num_cached_free,
               f"num_cached_free is {self.num_cached_free} but {cached_free} free blocks carry a hash")


def _check(condition: bool, message: str) -> None:
    # Not `assert`: the checks must still run under `python -O`.
    if not condition:
        raise AssertionError(message)


@dataclass(frozen=True)
class BlockRelease:
    """What dropping one request's references did: its table, and where each of its blocks ended up."""

    block_ids: list[int]
    num_freed: int  # refcount 0 and no hash: plain free blocks, taken first
    num_kept_cached: int  # refcount 0 but hashed: reusable by a later prefix hit until evicted
    num_still_shared: int  # still referenced by other requests


_NOTHING_RELEASED = BlockRelease([], 0, 0, 0)


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of the cache's counters; tokens for the prefix-cache numbers."""

    num_blocks: int
    num_free_blocks: int
    usage: float
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    evictions: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class KVCacheManager:
    """Per-request block tables over one `BlockPool`, with prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 events: KVEventLog | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, events)
        self._tables: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each table have been offered to the index (hit or published).
        self._num_published: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens of admitted requests looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens served from cached blocks

    # ---- sizes -------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any request (cached or not): what `allocate` can take."""
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    @property
    def evictions(self) -> int:
        return self.pool.evictions

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks, num_free_blocks=self.num_free_blocks, usage=self.usage,
            num_cached_blocks=self.pool.num_cached, prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits, evictions=self.evictions)

    # ---- the three verbs ---------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest prefix of `request` whose full blocks are cached, and how many tokens it covers.

        Stops one token short of the request's tokens so the step still computes the last token (its
        logits are needed to sample). Call only for a request holding no blocks (new or preempted). The
        returned blocks are not yet referenced: pass them to `allocate` before anything else allocates.
        """
        if request.num_computed_tokens != 0 or request.request_id in self._tables:
            raise ValueError(f"{request.request_id}: prefix lookup is only for a request holding no blocks")
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need the logits of every prompt position: nothing may be skipped
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
        num_computed_from_cache: int = 0,
    ) -> list[KVBlock] | None:
        """Make the request's table hold `num_computed_tokens + num_computed_from_cache + num_new_tokens`.

        Returns the newly taken blocks, or None, changing nothing, if the pool is short. `computed_blocks`
        are the prefix hits from `get_computed_blocks` (first allocation only): they get a reference and
        leave the free queue. Blocks that become full with this step's tokens are published to the prefix
        index now, which is safe because a step writes all its K/V before any attention reads them.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        if len(computed_blocks) * self.block_size != num_computed_from_cache:
            raise ValueError("num_computed_from_cache must cover exactly the computed blocks")
        request_id = request.request_id
        table = self._tables.get(request_id)
        if table is not None and not computed_blocks and self.fits_held(request, num_new_tokens):
            return []
        if computed_blocks and (table or request.num_computed_tokens):
            raise ValueError(f"{request_id}: prefix hits can only seed an empty block table")
        total_tokens = request.num_computed_tokens + num_computed_from_cache + num_new_tokens
        num_held = len(table) if table is not None else 0
        num_needed = max(0, self.num_blocks_for(total_tokens) - num_held - len(computed_blocks))
        # Hits sitting in the free queue are counted as free but cannot also serve as new blocks.
        num_revived = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_needed > self.pool.num_free - num_revived:
            return None

        if table is None:
            table = self._tables[request_id] = []
            self._num_published[request_id] = 0
            if self.enable_caching:
                # Counted per admission, not per lookup, so a request blocked for many steps counts once.
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_computed_from_cache
        self.pool.touch(computed_blocks)
        table.extend(computed_blocks)
        self._num_published[request_id] += len(computed_blocks)
        new_blocks = self.pool.take(num_needed)
        table.extend(new_blocks)
        if self.enable_caching:
            self._publish_full_blocks(request, table, min(total_tokens, request.num_tokens))
        return new_blocks

    def fits_held(self, request: Request, num_new_tokens: int) -> bool:
        """Whether `allocate(request, num_new_tokens)` has nothing to do: the tokens fit in the blocks held
        and fill none of them, so there is nothing to take, hash or publish (the common decode step)."""
        table = self._tables.get(request.request_id)
        if table is None:
            return False
        total_tokens = request.num_computed_tokens + num_new_tokens
        if total_tokens > len(table) * self.block_size:
            return False
        num_tokens = len(request.all_token_ids)
        return (not self.enable_caching or (total_tokens if total_tokens < num_tokens else num_tokens)
                // self.block_size <= self._num_published[request.request_id])

    def publish_computed(self, request: Request) -> None:
        """Publish the full blocks among the request's computed tokens not yet offered to the index (a
        speculative step's accepted drafts: allocation saw them only as drafts, which are never hashed)."""
        table = self._tables.get(request.request_id)
        if table is not None and self.enable_caching:
            self._publish_full_blocks(request, table, min(request.num_computed_tokens, request.num_tokens))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after new weights); False, changing nothing, while any
        request holds blocks. Counters are kept: clearing is not eviction."""
        return self.pool.reset_prefix_cache()

    def free(self, request: Request) -> BlockRelease:
        """Drop every block reference the request holds; its cached blocks stay reusable until evicted.

        Blocks are released tail first, so the tail of a sequence sits nearer the front of the free queue
        and is evicted before its head (which other requests are likelier to share).
        """
        table = self._tables.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
        if not table:
            return _NOTHING_RELEASED
        self.pool.release(reversed(table))
        freed = kept = shared = 0
        for block in table:
            if block.ref_cnt > 0:
                shared += 1
            elif block.block_hash is not None:
                kept += 1
            else:
                freed += 1
        return BlockRelease([block.block_id for block in table], freed, kept, shared)

    # ---- handoff: blocks that arrive with their K/V ------------------------------------------------

    def adopt(self, request: Request, plan: Sequence[KVBlock | None]) -> list[KVBlock] | None:
        """Give an imported request (holding nothing) the table `plan`: a matched block (a prefix hit,
        touched) or None (a fresh block, for K/V the caller writes now) per position.

        Returns the fresh blocks in plan order, or None, changing nothing, if the pool is short. The
        request's full blocks among its `num_computed_tokens` are published, as `allocate` would have.
        """
        if request.request_id in self._tables:
            raise ValueError(f"{request.request_id}: adopt is only for a request holding no blocks")
        matched = [block for block in plan if block is not None]
        num_fresh = len(plan) - len(matched)
        if num_fresh > self.pool.num_free - sum(1 for block in matched if block.ref_cnt == 0):
            return None
        self.pool.touch(matched)
        fresh = self.pool.take(num_fresh)
        taken = iter(fresh)
        self._tables[request.request_id] = [block if block is not None else next(taken) for block in plan]
        self._num_published[request.request_id] = 0
        if self.enable_caching:
            self._publish_full_blocks(request, self._tables[request.request_id], request.num_computed_tokens)
        return fresh

    def store_cached(self, blocks: Sequence[tuple[int, int | None, Sequence[int]]],
                     write: Callable[[int, int], None]) -> int:
        """Store full blocks from elsewhere, unreferenced and reusable: (hash, parent hash, token ids) each.

        Hashes already indexed are skipped; `write(block_id, i)` fills block i's K/V. Takes free blocks
        as allocation does (evicting the oldest cached ones) and returns how many were stored.
        """
        if not self.enable_caching:
            return 0
        stored = 0
        for i, (block_hash, parent_hash, token_ids) in enumerate(blocks):
            if self.pool.lookup(block_hash) is not None:
                continue
            if self.pool.num_free == 0:
                break
            block = self.pool.take(1)[0]
            write(block.block_id, i)
            self.pool.publish_one(block, block_hash, parent_hash, token_ids, self.block_size)
            self.pool.release([block])
            stored += 1
        return stored

    def block_hashes(self, request: Request) -> list[int]:
        """The chained hashes of every full block of the request's tokens (computed or not)."""
        self._update_block_hashes(request)
        return request.block_hashes

    # ---- reading -----------------------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as physical block ids (empty if it holds none)."""
        return [block.block_id for block in self._tables.get(request_id, ())]

    def get_blocks(self, request_id: str) -> list[KVBlock]:
        return list(self._tables.get(request_id, ()))

    def num_blocks_held(self, request_id: str) -> int:
        table = self._tables.get(request_id)
        return len(table) if table is not None else 0

    def num_slots_without_eviction(self, request_id: str) -> int:
        """Token slots the request's table can reach taking only free blocks that hold no cached prefix
        (the free queue keeps those at its front, so `allocate` takes them first)."""
        table = self._tables.get(request_id)
        num_held = len(table) if table is not None else 0
        return (num_held + self.pool.num_free - self.pool.num_cached_free) * self.block_size

    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def check_invariants(self, live_requests: Iterable[Request]) -> None:
        """Raise AssertionError unless pool and tables agree (used by tests).

        Free + referenced = total, each block in exactly one state, every cached hash resolves to a block
        carrying it, each block's refcount equals its number of block-table entries, and only live
        requests hold tables.
        """
        self.pool.check_invariants()
        live_ids = {request.request_id for request in live_requests}
        stale = set(self._tables) - live_ids
        _check(not stale, f"requests no longer live still hold blocks: {sorted(stale)}")
        entries: dict[int, int] = {}
        for request_id, table in self._tables.items():
            ids = [block.block_id for block in table]
            _check(len(set(ids)) == len(ids), f"{request_id} holds a block twice: {ids}")
            for block_id in ids:
                entries[block_id] = entries.get(block_id, 0) + 1
        for block in self.pool.blocks:
            _check(block.ref_cnt == entries.get(block.block_id, 0),
                   f"block {block.block_id} has refcount {block.ref_cnt} but "
                   f"{entries.get(block.block_id, 0)} block-table entries")
        _check(sum(b.ref_cnt for b in self.pool.blocks) == sum(len(t) for t in self._tables.values()),
               "sum of refcounts != number of block-table entries")

    # ---- internals ---------------------------------------------------------------------------------

    def _update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` to every full block of its tokens, hashing only new blocks."""
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        if len(hashes) >= num_full:
            return
        size = self.block_size
        hashes.extend(block_hash_chain(request.all_token_ids[len(hashes) * size:num_full * size], size,
                                       request.cache_salt, hashes[-1] if hashes else None))

    def _publish_full_blocks(self, request: Request, table: list[KVBlock], num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        start = self._num_published[request.request_id]
        if num_full <= start:
            return
        self._update_block_hashes(request)
        if self.pool.events is not None:
            self.pool.publish_recorded(table, request.block_hashes, start, num_full,
                                       request.all_token_ids, self.block_size)
        else:
            for i in range(start, num_full):
                self.pool.publish(table[i], request.block_hashes[i])
        self._num_published[request.request_id] = num_full
