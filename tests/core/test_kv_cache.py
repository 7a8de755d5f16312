"""KV cache bookkeeping: free LRU queue, refcounts, prefix index, allocation and freeing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenloop.core import kv_cache as kv_module
from tokenloop.core.block_pool import BlockPool, FreeBlockQueue, KVBlock
from tokenloop.core.kv_cache import KVCacheManager, hash_block
from tokenloop.request import Request, SamplingParams

BS = 4


def make_request(request_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=8), 0, cache_salt=salt)


def admit(kv: KVCacheManager, request: Request, num_tokens: int | None = None) -> list[KVBlock] | None:
    """Prefix lookup + allocation of the rest of the request (or `num_tokens` of it), like the scheduler."""
    hits, num_hit = kv.get_computed_blocks(request)
    n = (request.num_tokens - num_hit) if num_tokens is None else num_tokens
    new = kv.allocate(request, n, hits, num_hit)
    if new is not None:
        request.num_computed_tokens = num_hit + n
    return new


def free_order(kv: KVCacheManager) -> list[int]:
    return [block.block_id for block in kv.pool.free_queue]


def snapshot(kv: KVCacheManager) -> tuple:
    pool = kv.pool
    return (free_order(kv), [(b.ref_cnt, b.block_hash) for b in pool.blocks], sorted(pool.cached_items()),
            {rid: kv.get_block_ids(rid) for rid in list(kv._tables)}, dict(kv._num_published),
            kv.prefix_cache_queries, kv.prefix_cache_hits, pool.evictions)


# ---- hashing ---------------------------------------------------------------------------------------

def test_hash_is_stable_across_processes_and_runs() -> None:
    golden = hash_block(None, [1, 2, 3, 4], None)
    # Pinned: a changed encoding would silently invalidate any hashes persisted or compared across runs.
    assert golden == 0xB2C41770D5616D1C
    assert hash_block(7, [5], "salt") == 0xA1308B8AEF51288A
    code = ("from tokenloop.core.kv_cache import hash_block;"
            "print(hash_block(None, [1, 2, 3, 4], None), hash_block(7, [5], 'salt'))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == [str(golden), str(hash_block(7, [5], "salt"))]
    assert 0 <= golden < 2**64


def test_hash_separates_parent_tokens_and_salt() -> None:
    base = hash_block(None, [1, 2, 3, 4])
    variants = {hash_block(0, [1, 2, 3, 4]), hash_block(1, [1, 2, 3, 4]), hash_block(None, [1, 2, 3, 5]),
                hash_block(None, [1, 2, 3, 4], "a"), hash_block(None, [1, 2, 3, 4], "b"),
                hash_block(None, [1, 2, 3]), hash_block(None, [2**40, 2, 3, 4])}
    assert base not in variants and len(variants) == 7
    assert hash_block(None, [1, 2, 3, 4], "") == base  # an empty salt is no salt


# ---- free queue ------------------------------------------------------------------------------------

def test_free_queue_is_a_doubly_linked_lru() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks[:3])
    assert [b.block_id for b in queue] == [0, 1, 2] and len(queue) == 3
    queue.remove(blocks[1])  # from the middle
    queue.append(blocks[3])
    queue.appendleft(blocks[4])
    assert [b.block_id for b in queue] == [4, 0, 2, 3]
    assert queue.popleft() is blocks[4] and not blocks[4].in_free_queue
    with pytest.raises(RuntimeError):
        queue.append(blocks[0])  # already queued
    with pytest.raises(RuntimeError):
        queue.remove(blocks[1])  # not queued
    for _ in range(3):
        queue.popleft()
    with pytest.raises(RuntimeError):
        queue.popleft()
    assert len(queue) == 0


# ---- pool placement and eviction -------------------------------------------------------------------

def test_hashed_blocks_go_to_the_back_and_unhashed_to_the_front() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    request = make_request("a", list(range(6)))  # one full block + a partial one
    assert admit(kv, request) is not None
    full, partial = kv.get_blocks("a")
    assert full.block_hash is not None and partial.block_hash is None
    kv.free(request)
    order = free_order(kv)
    assert order[0] == partial.block_id  # worthless: reused first
    assert order[-1] == full.block_id  # cached: evicted last
    kv.check_invariants([])


def test_lru_eviction_order_and_eviction_count() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    requests = [make_request(name, [10 * i + t for t in range(BS)]) for i, name in enumerate("abcd")]
    for request in requests:
        assert admit(kv, request) is not None
    for request in requests:  # freed oldest first: a's block is the least recently used
        kv.free(request)
    hashes = [request.block_hashes[0] for request in requests]
    assert [kv.pool.lookup(h) is not None for h in hashes] == [True] * 4
    newcomer = make_request("e", list(range(100, 100 + 2 * BS)))
    assert admit(kv, newcomer, BS) is not None  # takes one block
    assert kv.pool.lookup(hashes[0]) is None and kv.evictions == 1
    assert kv.allocate(newcomer, BS) is not None  # and a second one
    assert kv.pool.lookup(hashes[1]) is None and kv.evictions == 2
    assert all(kv.pool.lookup(h) is not None for h in hashes[2:])
    kv.check_invariants([newcomer])


def test_free_releases_tail_first() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    request = make_request("a", list(range(3 * BS + 1)))  # 3 full blocks, last token not needed
    assert admit(kv, request, 3 * BS) is not None
    ids = kv.get_block_ids("a")
    kv.free(request)
    assert free_order(kv) == ids[::-1]  # the tail is evicted before the head


# ---- prefix lookup ---------------------------------------------------------------------------------

def test_prefix_hit_stops_one_token_short() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    first = make_request("a", list(range(2 * BS)))
    admit(kv, first)
    ids = kv.get_block_ids("a")
    kv.free(first)
    same = make_request("b", list(range(2 * BS)))
    hits, num_hit = kv.get_computed_blocks(same)
    assert num_hit == BS and len(hits) == 1  # the last block must be computed again: its logits matter
    longer = make_request("c", list(range(2 * BS + 1)))
    hits, num_hit = kv.get_computed_blocks(longer)
    assert num_hit == 2 * BS and [b.block_id for b in hits] == ids
    one = make_request("d", [0])
    assert kv.get_computed_blocks(one) == ([], 0)


def test_prefix_lookup_stops_at_first_miss() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", list(range(3 * BS))))
    diverged = make_request("b", list(range(BS)) + [99] * BS + list(range(2 * BS, 3 * BS + 1)))
    hits, num_hit = kv.get_computed_blocks(diverged)
    assert num_hit == BS  # the third block matches by tokens, but its chain (parent) differs


def test_cache_salt_separates_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_request("a", list(range(2 * BS)), salt="alice"))
    assert kv.get_computed_blocks(make_request("b", list(range(2 * BS + 1)), salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", list(range(2 * BS + 1))))[1] == 0
    assert kv.get_computed_blocks(make_request("d", list(range(2 * BS + 1)), salt="alice"))[1] == 2 * BS


def test_lookup_requires_a_request_without_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", list(range(BS + 1)))
    admit(kv, request, BS)
    with pytest.raises(ValueError):
        kv.get_computed_blocks(request)


def test_block_hashes_are_computed_incrementally(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = kv_module.hash_block

    def counting(parent: int | None, tokens, salt=None) -> int:  # type: ignore[no-untyped-def]
        calls.append(len(tokens))
        return real(parent, tokens, salt)

    monkeypatch.setattr(kv_module, "hash_block", counting)
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", list(range(3 * BS + 2)))
    admit(kv, request)
    assert len(calls) == 3 and len(request.block_hashes) == 3
    for token in (50, 51):  # decode two tokens: the fourth block fills up
        request.append_output_token(token)
        assert kv.allocate(request, 1) is not None
        request.num_computed_tokens += 1
    assert len(calls) == 4 and len(request.block_hashes) == 4
    assert request.block_hashes[3] == real(request.block_hashes[2], request.all_token_ids[3 * BS:4 * BS])


# ---- allocate --------------------------------------------------------------------------------------

def test_allocate_returns_none_and_changes_nothing_when_short() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(2 * BS)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(2 * BS)) + [7] * (2 * BS + 1))  # hits a's blocks, needs 3 more
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 2 * BS
    before = snapshot(kv)
    # 4 blocks are free, but 2 of them are b's own hits: only 2 can be new blocks.
    assert kv.allocate(b, b.num_tokens - num_hit, hits, num_hit) is None
    assert snapshot(kv) == before
    kv.check_invariants([])
    assert kv.allocate(b, 2 * BS, hits, num_hit) is not None  # 2 new blocks do fit
    assert kv.num_free_blocks == 0
    kv.check_invariants([b])


def test_allocate_short_for_a_running_request_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    a = make_request("a", list(range(2 * BS)) + [1])
    admit(kv, a, 2 * BS)
    before = snapshot(kv)
    assert kv.allocate(a, 1) is None
    assert snapshot(kv) == before


def test_allocate_grows_only_when_a_block_fills() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", list(range(BS - 1)))
    assert len(admit(kv, request) or []) == 1
    request.append_output_token(1)
    assert kv.allocate(request, 1) == []  # fits in the partial block
    request.num_computed_tokens += 1
    request.append_output_token(2)
    assert len(kv.allocate(request, 1) or []) == 1


def test_hits_in_the_free_queue_are_touched_out_of_it() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(2 * BS)))
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 6
    b = make_request("b", list(range(2 * BS + 3)))
    assert admit(kv, b) is not None
    hit_blocks = kv.get_blocks("b")[:2]
    assert all(block.ref_cnt == 1 and not block.in_free_queue for block in hit_blocks)
    assert kv.num_free_blocks == 3  # 2 revived + 1 new
    kv.check_invariants([b])


def test_shared_blocks_are_refcounted() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(2 * BS + 1)))
    b = make_request("b", list(range(2 * BS + 1)))
    admit(kv, a)
    admit(kv, b)
    shared = kv.get_blocks("a")[:2]
    assert kv.get_blocks("b")[:2] == shared and all(block.ref_cnt == 2 for block in shared)
    kv.free(a)
    assert all(block.ref_cnt == 1 and not block.in_free_queue for block in shared)
    kv.check_invariants([b])
    kv.free(b)
    assert all(block.ref_cnt == 0 and block.in_free_queue for block in shared)
    kv.check_invariants([])


def test_only_blocks_full_of_computed_tokens_are_published() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    request = make_request("a", list(range(2 * BS + 1)))
    admit(kv, request, BS + 2)  # a chunk: block 0 full, block 1 half
    first, second = kv.get_blocks("a")
    assert first.block_hash == request.block_hashes[0] and second.block_hash is None
    assert kv.allocate(request, BS - 2) is not None
    assert second.block_hash == request.block_hashes[1]


def test_a_block_computed_twice_is_indexed_once() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(BS + 1)))
    b = make_request("b", list(range(BS + 1)))
    hits_a, hits_b = kv.get_computed_blocks(a), kv.get_computed_blocks(b)  # both miss
    assert kv.allocate(a, a.num_tokens, *hits_a) is not None
    assert kv.allocate(b, b.num_tokens, *hits_b) is not None
    first_a, first_b = kv.get_blocks("a")[0], kv.get_blocks("b")[0]
    assert first_a.block_hash is not None and first_b.block_hash is None
    kv.check_invariants([a, b])
    kv.free(b)
    assert free_order(kv)[0] == first_b.block_id  # the anonymous copy is reused first
    kv.check_invariants([a])


def test_free_keeps_hashes_reusable_and_is_idempotent() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(3 * BS)))
    admit(kv, a)
    ids = kv.get_block_ids("a")
    kv.free(a)
    kv.free(a)  # a second free is a no-op
    assert kv.get_block_ids("a") == [] and kv.num_free_blocks == 8 and kv.usage == 0.0
    again = make_request("a2", list(range(3 * BS)))
    hits, num_hit = kv.get_computed_blocks(again)
    assert [b.block_id for b in hits] == ids[:2] and num_hit == 2 * BS
    kv.check_invariants([])


def test_stats_count_queries_hits_and_evictions() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(2 * BS + 1)))
    admit(kv, a)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (2 * BS + 1, 0)
    b = make_request("b", list(range(2 * BS + 1)))
    admit(kv, b)
    stats = kv.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (4 * BS + 2, 2 * BS)
    assert stats.prefix_cache_hit_rate == pytest.approx(2 * BS / (4 * BS + 2))
    assert stats.num_free_blocks == 0 and stats.usage == 1.0 and stats.num_cached_blocks == 2
    # A blocked admission is not counted again and again.
    c = make_request("c", list(range(50, 50 + BS)))
    assert admit(kv, c) is None
    assert kv.prefix_cache_queries == 4 * BS + 2
    kv.free(a)
    kv.free(b)
    assert admit(kv, c) is not None and kv.evictions == 0  # took the unhashed partial blocks first
    d = make_request("d", list(range(70, 70 + 3 * BS)))
    assert admit(kv, d, 3 * BS) is not None and kv.evictions == 2


def test_caching_disabled_never_hits_or_hashes() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(2 * BS + 1)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(2 * BS + 1)))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert all(block.block_hash is None for block in kv.pool.blocks) and not b.block_hashes
    assert kv.prefix_cache_queries == 0
    kv.check_invariants([])


def test_check_invariants_catches_corruption() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(BS + 1)))
    admit(kv, a)
    with pytest.raises(AssertionError):
        kv.check_invariants([])  # a holds blocks but is not live
    kv.get_blocks("a")[0].ref_cnt += 1
    with pytest.raises(AssertionError):
        kv.check_invariants([a])


def test_pool_rejects_bad_sizes_and_double_release() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)
    pool = BlockPool(2)
    (block,) = pool.take(1)
    pool.release([block])
    with pytest.raises(RuntimeError):
        pool.release([block])
    with pytest.raises(RuntimeError):
        pool.take(3)


# ---- randomized: allocate / grow / free against a model of the K/V contents --------------------------

class KVCacheMachine(RuleBasedStateMachine):
    """Random admissions, decode growth and frees on a tiny pool; after each step the pool is consistent
    and every block a request reads holds exactly that request's tokens (prefix hits are never wrong)."""

    @initialize(num_blocks=st.integers(2, 10), caching=st.booleans())
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.kv = KVCacheManager(num_blocks, BS, caching)
        self.live: dict[str, Request] = {}
        self.contents: dict[int, list[int | None]] = {i: [None] * BS for i in range(num_blocks)}
        self.next_id = 0

    def _write_and_check(self, request: Request, start: int, end: int) -> None:
        table = self.kv.get_block_ids(request.request_id)
        assert len(table) * BS >= end
        for pos in range(start, end):
            self.contents[table[pos // BS]][pos % BS] = request.all_token_ids[pos]
        for pos in range(end):
            assert self.contents[table[pos // BS]][pos % BS] == request.all_token_ids[pos]

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=9), salt=st.sampled_from([None, "s"]),
          chunk=st.integers(1, 12))
    def admit(self, prefix: list[int], tail: list[int], salt: str | None, chunk: int) -> None:
        request = make_request(f"r{self.next_id}", prefix + tail, salt)
        self.next_id += 1
        hits, num_hit = self.kv.get_computed_blocks(request)
        assert num_hit < request.num_tokens
        n = min(chunk, request.num_tokens - num_hit)
        if self.kv.allocate(request, n, hits, num_hit) is not None:
            request.num_computed_tokens = num_hit + n
            self.live[request.request_id] = request
            self._write_and_check(request, num_hit, num_hit + n)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def step(self, data: st.DataObject, token: int) -> None:
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(token)  # caught up: "sample" a token, then compute it
        n = request.num_tokens - request.num_computed_tokens
        start = request.num_computed_tokens
        if self.kv.allocate(request, n) is not None:
            request.num_computed_tokens += n
            self._write_and_check(request, start, start + n)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(request)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "kv"):
            self.kv.check_invariants(self.live.values())

    def teardown(self) -> None:
        if hasattr(self, "kv"):
            for request in self.live.values():
                self.kv.free(request)
            self.kv.check_invariants([])
            assert self.kv.num_free_blocks == self.kv.num_blocks


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
