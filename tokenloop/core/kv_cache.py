"""The paged KV cache's per-request bookkeeping: block tables over the `BlockPool`, prefix hits, the hashes.

`KVCacheManager` keeps one block table per KV group per request: `allocate` grows them for the tokens a
step computes, `get_computed_blocks` finds the longest cached prefix of a new or preempted request, `free`
drops them. The blocks themselves (refcounts, the free queue, the prefix index) are `core/block_pool.py`'s.
Only bookkeeping lives here; the K/V tensors belong to the model runner, which addresses them by block id.

Long module: one state, the requests' block tables, which every verb here (allocate, prefix hits over the
groups, a sliding window's release, adopt, free) reads and writes together with its invariant check.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenloop.config import KVGroup
from tokenloop.core.block_pool import BlockPool, KVBlock, check_invariant
from tokenloop.core.kv_events import KVEventLog

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
    """Per-request block tables, one per KV group, over one `BlockPool`, with prefix caching.

    Every group's table of a request has one entry per block position of its tokens, so all of them have
    the same length. A sliding group (docs/kv-groups.md) releases the blocks its window has passed: their
    entries become `released_block` (id -1, never read) and their references go back to the pool.
    The one-group calls (`get_block_ids`, `get_blocks`, `allocate`'s result) speak of group 0.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 events: KVEventLog | None = None, groups: Sequence[KVGroup] = (KVGroup(),)) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if not groups:
            raise ValueError("a KV cache needs at least one group")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = tuple(groups)
        self.pool = BlockPool(num_blocks, enable_caching, events, len(self.groups))
        self.released_block = KVBlock(-1)  # the entry of a position a sliding window has passed
        # (group, window) of each sliding group; empty for a model whose layers are all full.
        self._sliding = tuple((g, spec.window) for g, spec in enumerate(self.groups) if spec.kind == "sliding")
        self._tables: dict[str, list[list[KVBlock]]] = {}
        # How many leading blocks of each table have been offered to the index (hit or published).
        self._num_published: dict[str, int] = {}
        # Per request and sliding group: how many leading entries are released (they are `released_block`).
        self._num_released: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0  # tokens of admitted requests looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens served from cached blocks

    # ---- sizes -------------------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.groups)

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
        """Block positions needed to hold `num_tokens` tokens (blocks of one group)."""
        return -(-num_tokens // self.block_size)

    def blocks_to_hold(self, num_tokens: int, chunk: int) -> int:
        """The most blocks, over every group, one request of `num_tokens` tokens computed in steps of at
        most `chunk` tokens ever holds: a sliding group holds its window before a step plus the step."""
        positions = self.num_blocks_for(num_tokens)
        window_positions = [min(positions, self.num_blocks_for(window - 1 + chunk) + 1)
                            for _, window in self._sliding]
        return positions * (self.num_groups - len(window_positions)) + sum(window_positions)

    def max_tokens_alone(self, chunk: int) -> int:
        """The most tokens one request can grow to in the whole pool, computed in steps of at most `chunk`."""
        low, high = 0, self.num_blocks * self.block_size  # blocks_to_hold grows with the tokens: bisect
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.blocks_to_hold(mid, chunk) <= self.num_blocks else (low, mid - 1)
        return low

    def first_live_block(self, num_computed_tokens: int, window: int) -> int:
        """The first block position a sliding group of `window` still needs once `num_computed_tokens`
        are computed: the one holding the oldest key the next query (at that position) sees."""
        return max(0, num_computed_tokens - window + 1) // self.block_size

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks, num_free_blocks=self.num_free_blocks, usage=self.usage,
            num_cached_blocks=self.pool.num_cached, prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits, evictions=self.evictions)

    # ---- the three verbs ---------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest prefix of `request` that every group can serve from cached blocks, as group 0's
        blocks, and how many tokens it covers.

        A full group needs every block of the prefix, a sliding group the blocks its window covers at the
        prefix's end. Stops one token short of the request's tokens so the step still computes the last
        token (its logits are needed to sample). Call only for a request holding no blocks (new or
        preempted). The returned blocks are not yet referenced: pass them to `allocate` before anything
        else allocates (it finds the other groups' blocks by the same hashes).
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
        if self.num_groups > 1 and hits:
            del hits[self._hit_over_groups(request.block_hashes, len(hits)):]
        return hits, len(hits) * self.block_size

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
        num_computed_from_cache: int = 0,
    ) -> list[KVBlock] | None:
        """Make the request's tables hold `num_computed_tokens + num_computed_from_cache + num_new_tokens`.

        Returns group 0's newly taken blocks, or None if the pool is short, changing nothing but releasing
        what sliding windows have passed (which happens first, every call). `computed_blocks` are the
        prefix hits from `get_computed_blocks` (first allocation only): they and the other groups' blocks
        at the same hashes get a reference and leave the free queue. Blocks that become full with this
        step's tokens are published to the prefix index now, which is safe because a step writes all its
        K/V before any attention reads them.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        if len(computed_blocks) * self.block_size != num_computed_from_cache:
            raise ValueError("num_computed_from_cache must cover exactly the computed blocks")
        request_id = request.request_id
        tables = self._tables.get(request_id)
        if tables is not None and not computed_blocks and self.fits_held(request, num_new_tokens):
            return []
        if computed_blocks and (tables or request.num_computed_tokens):
            raise ValueError(f"{request_id}: prefix hits can only seed an empty block table")
        if tables is not None and self._sliding:
            self._release_passed(request_id, tables, request.num_computed_tokens)
        hits = self._group_hits(request, computed_blocks)
        total_tokens = request.num_computed_tokens + num_computed_from_cache + num_new_tokens
        num_held = len(tables[0]) if tables is not None else 0
        num_per_group = max(0, self.num_blocks_for(total_tokens) - num_held - len(computed_blocks))
        # Hits sitting in the free queue are counted as free but cannot also serve as new blocks.
        num_revived = sum(1 for group_hits in hits for block in group_hits
                          if block.ref_cnt == 0 and block.block_id >= 0)
        if num_per_group * self.num_groups > self.pool.num_free - num_revived:
            return None

        if tables is None:
            tables = self._new_tables(request, hits, num_computed_from_cache)
        for table, group_hits in zip(tables, hits):  # every hit leaves the free queue before any take
            self.pool.touch(block for block in group_hits if block.block_id >= 0)
            table.extend(group_hits)
        new_blocks: list[KVBlock] = []
        for group, table in enumerate(tables):
            taken = self.pool.take(num_per_group, group)
            table.extend(taken)
            if group == 0:
                new_blocks = taken
        self._num_published[request_id] += len(computed_blocks)
        if self.enable_caching:
            self._publish_full_blocks(request, tables, min(total_tokens, request.num_tokens))
        return new_blocks

    def fits_held(self, request: Request, num_new_tokens: int) -> bool:
        """Whether `allocate(request, num_new_tokens)` has nothing to do: the tokens fit in the blocks held
        and fill none of them, so there is nothing to take, hash or publish (the common decode step), and
        no sliding window has passed a block held."""
        tables = self._tables.get(request.request_id)
        if tables is None:
            return False
        total_tokens = request.num_computed_tokens + num_new_tokens
        if total_tokens > len(tables[0]) * self.block_size:
            return False
        if self._sliding and self._has_passed(request):
            return False
        num_tokens = len(request.all_token_ids)
        return (not self.enable_caching or (total_tokens if total_tokens < num_tokens else num_tokens)
                // self.block_size <= self._num_published[request.request_id])

    def publish_computed(self, request: Request) -> None:
        """Publish the full blocks among the request's computed tokens not yet offered to the index (a
        speculative step's accepted drafts: allocation saw them only as drafts, which are never hashed)."""
        tables = self._tables.get(request.request_id)
        if tables is not None and self.enable_caching:
            self._publish_full_blocks(request, tables, min(request.num_computed_tokens, request.num_tokens))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after new weights); False, changing nothing, while any
        request holds blocks. Counters are kept: clearing is not eviction."""
        return self.pool.reset_prefix_cache()

    def free(self, request: Request) -> BlockRelease:
        """Drop every block reference the request holds; its cached blocks stay reusable until evicted.

        Blocks are released tail first, so the tail of a sequence sits nearer the front of the free queue
        and is evicted before its head (which other requests are likelier to share).
        """
        tables = self._tables.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
        self._num_released.pop(request.request_id, None)
        if not tables or not tables[0]:
            return _NOTHING_RELEASED
        held = [block for table in tables for block in table if block.block_id >= 0]
        for table in tables:
            self.pool.release(block for block in reversed(table) if block.block_id >= 0)
        freed = kept = shared = 0
        for block in held:
            if block.ref_cnt > 0:
                shared += 1
            elif block.block_hash is not None:
                kept += 1
            else:
                freed += 1
        return BlockRelease([block.block_id for block in held], freed, kept, shared)

    # ---- handoff: blocks that arrive with their K/V ------------------------------------------------

    def adopt(self, request: Request, plans: Sequence[Sequence[KVBlock | None]]) -> list[list[KVBlock]] | None:
        """Give an imported request (holding nothing) one table per group, `plans[g]`: per position a
        matched block (a prefix hit, touched; or `released_block` before a sliding window), or None (a
        fresh block, for K/V the caller writes now).

        Returns each group's fresh blocks in plan order, or None, changing nothing, if the pool is short.
        The request's full blocks among its `num_computed_tokens` are published, as `allocate` would have.
        """
        if request.request_id in self._tables:
            raise ValueError(f"{request.request_id}: adopt is only for a request holding no blocks")
        if len(plans) != self.num_groups or len({len(plan) for plan in plans}) != 1:
            raise ValueError(f"adopt needs {self.num_groups} plans of one length")
        matched = [block for plan in plans for block in plan if block is not None and block.block_id >= 0]
        num_fresh = sum(1 for plan in plans for block in plan if block is None)
        if num_fresh > self.pool.num_free - sum(1 for block in matched if block.ref_cnt == 0):
            return None
        self.pool.touch(matched)
        tables: list[list[KVBlock]] = []
        fresh: list[list[KVBlock]] = []
        for group, plan in enumerate(plans):
            fresh.append(self.pool.take(sum(1 for block in plan if block is None), group))
            taken = iter(fresh[-1])
            tables.append([block if block is not None else next(taken) for block in plan])
        self._tables[request.request_id] = tables
        self._num_published[request.request_id] = 0
        if self._sliding:
            self._num_released[request.request_id] = [
                sum(1 for block in tables[g] if block.block_id < 0) for g, _ in self._sliding]
        if self.enable_caching:
            self._publish_full_blocks(request, tables, request.num_computed_tokens)
        return fresh

    def store_cached(self, blocks: Sequence[tuple[int, int | None, Sequence[int]]],
                     write: Callable[[int, int], None], group: int = 0, lora_name: str | None = None) -> int:
        """Store full blocks of `group` from elsewhere, unreferenced and reusable: (hash, parent hash, token
        ids) each.

        Hashes already indexed are skipped; `write(block_id, i)` fills block i's K/V. Takes free blocks
        as allocation does (evicting the oldest cached ones) and returns how many were stored.
        """
        if not self.enable_caching:
            return 0
        stored = 0
        for i, (block_hash, parent_hash, token_ids) in enumerate(blocks):
            if self.pool.lookup(block_hash, group) is not None:
                continue
            if self.pool.num_free == 0:
                break
            block = self.pool.take(1, group)[0]
            write(block.block_id, i)
            self.pool.publish_one(block, block_hash, parent_hash, token_ids, self.block_size, lora_name)
            self.pool.release([block])
            stored += 1
        return stored

    def block_hashes(self, request: Request) -> list[int]:
        """The chained hashes of every full block of the request's tokens (computed or not)."""
        self._update_block_hashes(request)
        return request.block_hashes

    # ---- reading -----------------------------------------------------------------------------------

    def get_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """One group's block table as physical block ids (-1 where a window has passed; empty if none)."""
        tables = self._tables.get(request_id)
        return [block.block_id for block in tables[group]] if tables is not None else []

    def get_blocks(self, request_id: str, group: int = 0) -> list[KVBlock]:
        tables = self._tables.get(request_id)
        return list(tables[group]) if tables is not None else []

    def num_blocks_held(self, request_id: str) -> int:
        """Block positions in the request's tables (the length of each group's table)."""
        tables = self._tables.get(request_id)
        return len(tables[0]) if tables is not None else 0

    def num_blocks_referenced(self, request_id: str) -> int:
        """Blocks the request references over every group (what it costs the pool now)."""
        tables = self._tables.get(request_id)
        return sum(1 for table in tables for block in table if block.block_id >= 0) if tables else 0

    def num_slots_without_eviction(self, request_id: str) -> int:
        """Token slots the request's tables can reach taking only free blocks that hold no cached prefix
        (the free queue keeps those at its front, so `allocate` takes them first), a block per group."""
        num_held = self.num_blocks_held(request_id)
        return (num_held + (self.pool.num_free - self.pool.num_cached_free) // self.num_groups) * self.block_size

    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def check_invariants(self, live_requests: Iterable[Request]) -> None:
        """Raise AssertionError unless pool and tables agree (used by tests).

        Free + referenced = total, each block in exactly one state, every cached hash resolves to a block
        carrying it, each block's refcount equals its number of block-table entries (all in tables of its
        group), only live requests hold tables, every group's table has the same length, and a sliding
        group's released entries are exactly its leading ones, none of them inside the window.
        """
        self.pool.check_invariants()
        live = {request.request_id: request for request in live_requests}
        stale = set(self._tables) - set(live)
        check_invariant(not stale, f"requests no longer live still hold blocks: {sorted(stale)}")
        entries: dict[int, int] = {}
        for request_id, tables in self._tables.items():
            check_invariant(len(tables) == self.num_groups and len({len(t) for t in tables}) == 1,
                   f"{request_id}'s tables are not one per group of one length")
            for group, table in enumerate(tables):
                ids = [block.block_id for block in table if block.block_id >= 0]
                check_invariant(len(set(ids)) == len(ids), f"{request_id} holds a block twice in group {group}: {ids}")
                for block in table:
                    if block.block_id >= 0:
                        check_invariant(block.group == group, f"block {block.block_id} of group {block.group} is in "
                                                     f"{request_id}'s table of group {group}")
                        entries[block.block_id] = entries.get(block.block_id, 0) + 1
            released = self._num_released.get(request_id, [0] * len(self._sliding))
            for k, (group, window) in enumerate(self._sliding):
                table = tables[group]
                check_invariant(all(block.block_id < 0 for block in table[:released[k]])
                       and all(block.block_id >= 0 for block in table[released[k]:]),
                       f"{request_id}'s group {group} has released entries other than its leading {released[k]}")
                check_invariant(released[k] <= self.first_live_block(live[request_id].num_computed_tokens, window),
                       f"{request_id}'s group {group} released a block its window still covers")
            for group in range(self.num_groups):
                if all(g != group for g, _ in self._sliding):
                    check_invariant(all(block.block_id >= 0 for block in tables[group]),
                           f"{request_id}'s full group {group} has a released entry")
        for block in self.pool.blocks:
            check_invariant(block.ref_cnt == entries.get(block.block_id, 0),
                   f"block {block.block_id} has refcount {block.ref_cnt} but "
                   f"{entries.get(block.block_id, 0)} block-table entries")

    # ---- internals ---------------------------------------------------------------------------------

    def _new_tables(self, request: Request, hits: list[list[KVBlock]], num_computed_from_cache: int,
                    ) -> list[list[KVBlock]]:
        """Empty tables for a request's first allocation (admitted or resumed), its sliding groups' counts of
        released entries from the prefix hits `hits`, and the admission in the prefix-cache counters."""
        request_id = request.request_id
        tables: list[list[KVBlock]] = [[] for _ in self.groups]
        self._tables[request_id] = tables
        self._num_published[request_id] = 0
        if self._sliding:
            self._num_released[request_id] = [
                sum(1 for block in hits[g] if block.block_id < 0) for g, _ in self._sliding]
        if self.enable_caching:
            # Counted per admission, not per lookup, so a request blocked for many steps counts once.
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed_from_cache
        return tables

    def _has_passed(self, request: Request) -> bool:
        """Whether a sliding window has passed a block the request still holds."""
        released = self._num_released[request.request_id]
        n = request.num_computed_tokens
        return any(self.first_live_block(n, window) > released[k] for k, (_, window) in enumerate(self._sliding))

    def _release_passed(self, request_id: str, tables: list[list[KVBlock]], num_computed_tokens: int) -> None:
        """Release each sliding group's blocks before its window; their entries become `released_block`."""
        released = self._num_released[request_id]
        for k, (group, window) in enumerate(self._sliding):
            start, end = released[k], self.first_live_block(num_computed_tokens, window)
            if end <= start:
                continue
            table = tables[group]
            passed = table[start:end]
            table[start:end] = [self.released_block] * (end - start)
            self.pool.release(reversed(passed))  # the newest first: the oldest stay cached longest
            released[k] = end

    def _hit_over_groups(self, block_hashes: Sequence[int], num_hits: int) -> int:
        """The longest hit, at most `num_hits` blocks (group 0's), that every other group can serve too."""
        runs: list[tuple[int, list[int]]] = []  # per other group: its window (0: full), cached-run lengths
        for group in range(1, self.num_groups):
            run, lengths = 0, []
            for block_hash in block_hashes[:num_hits]:
                run = run + 1 if self.pool.lookup(block_hash, group) is not None else 0
                lengths.append(run)
            runs.append((self.groups[group].window if self.groups[group].kind == "sliding" else 0, lengths))
        for num in range(num_hits, 0, -1):
            # A group serves `num` blocks when the blocks it needs at that point are cached, consecutively.
            if all(lengths[num - 1] >= num - (self.first_live_block(num * self.block_size, window) if window
                                               else 0) for window, lengths in runs):
                return num
        return 0

    def _group_hits(self, request: Request, computed_blocks: Sequence[KVBlock]) -> list[list[KVBlock]]:
        """Each group's table seed for a prefix hit whose group-0 blocks are `computed_blocks`."""
        hits = [list(computed_blocks)]
        num = len(computed_blocks)
        for group in range(1, self.num_groups):
            spec = self.groups[group]
            first = self.first_live_block(num * self.block_size, spec.window) if spec.kind == "sliding" else 0
            group_hits = [self.released_block] * first
            for block_hash in request.block_hashes[first:num]:
                block = self.pool.lookup(block_hash, group)
                if block is None:
                    raise ValueError(f"{request.request_id}: a prefix hit's block of group {group} is gone; "
                                     "allocate must follow get_computed_blocks")
                group_hits.append(block)
            hits.append(group_hits)
        return hits

    def _update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` to every full block of its tokens, hashing only new blocks."""
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        if len(hashes) >= num_full:
            return
        size = self.block_size
        hashes.extend(block_hash_chain(request.all_token_ids[len(hashes) * size:num_full * size], size,
                                       request.cache_salt, hashes[-1] if hashes else None))

    def _publish_full_blocks(self, request: Request, tables: list[list[KVBlock]], num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        start = self._num_published[request.request_id]
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for table in tables:
            if self.pool.events is not None:
                self.pool.publish_recorded(table, request.block_hashes, start, num_full,
                                           request.all_token_ids, self.block_size, request.lora_name)
            else:
                for i in range(start, num_full):
                    self.pool.publish(table[i], request.block_hashes[i])
        self._num_published[request.request_id] = num_full
