"""KV cache events: what the block pool records, the log's sequence and replay buffer, the consumer mirror."""

from __future__ import annotations

import json

import pytest
from hypothesis import event as note_event
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from tests.core.test_kv_cache import admit, make_request
from tokenloop.core.block_pool import KVBlock
from tokenloop.core.kv_cache import KVCacheManager, hash_block
from tokenloop.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventLog,
    KVIndexMirror,
    KVIndexSnapshot,
    batch_from_wire,
    batch_to_wire,
)
from tokenloop.request import Request

BS = 4
SALTS = (None, "s")


def index(kv: KVCacheManager) -> set[int]:
    return {block_hash for block_hash, _ in kv.pool.cached_items()}


def with_log(num_blocks: int = 8, max_batches: int = 4096) -> tuple[KVCacheManager, KVEventLog]:
    log = KVEventLog(max_batches)
    return KVCacheManager(num_blocks, BS, events=log), log


def drain(log: KVEventLog) -> list[KVEvent]:
    batch = log.flush(0)
    return [] if batch is None else batch.events


def check_chain(event: BlockStored, salts: tuple[str | None, ...] = SALTS) -> None:
    """The event's hashes are exactly the chain of its tokens from its parent (under one of the salts)."""
    size = event.block_size
    assert len(event.token_ids) == size * len(event.block_hashes)
    for salt in salts:
        parent, chain = event.parent_block_hash, []
        for i in range(len(event.block_hashes)):
            parent = hash_block(parent, event.token_ids[i * size:(i + 1) * size], salt)
            chain.append(parent)
        if chain == event.block_hashes:
            return
    raise AssertionError(f"hashes do not chain over the tokens: {event}")


def strict_replay(batches: list[KVEventBatch], state: set[int] | None = None) -> set[int]:
    """Replay from sequence 0 demanding that every event changes the state: a hash is stored only while
    absent and removed only while present (so a spurious or doubled event fails, not only a missing one)."""
    state = set() if state is None else state
    for expected_seq, batch in enumerate(batches):
        assert batch.seq == expected_seq and batch.events
        for event in batch.events:
            if isinstance(event, BlockStored):
                check_chain(event)
                assert not state & set(event.block_hashes), "stored a hash already held"
                assert len(set(event.block_hashes)) == len(event.block_hashes)
                state.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= state, "removed a hash not held"
                assert len(set(event.block_hashes)) == len(event.block_hashes)
                state.difference_update(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                state.clear()
    return state


# ---- what the pool records -------------------------------------------------------------------------

def test_blocks_published_together_are_one_stored_event() -> None:
    kv, log = with_log()
    request = make_request("a", list(range(2 * BS + 1)))
    admit(kv, request)
    assert drain(log) == [BlockStored(request.block_hashes[:2], None, list(range(2 * BS)), BS)]
    # decode until the third block fills: one event for it alone, chained to the second block
    for token in range(100, 100 + BS - 1):
        request.append_output_token(token)
        assert kv.allocate(request, 1) is not None
        request.num_computed_tokens += 1
        if token < 100 + BS - 2:
            assert log.num_pending == 0  # the block is not full yet
    (event,) = drain(log)
    assert event == BlockStored([request.block_hashes[2]], request.block_hashes[1],
                                request.all_token_ids[2 * BS:3 * BS], BS)
    check_chain(event)


def test_chunked_prefill_stores_each_chunk_with_its_parent() -> None:
    kv, log = with_log()
    request = make_request("a", list(range(3 * BS + 2)), salt="s")
    admit(kv, request, BS + 1)
    assert kv.allocate(request, 2 * BS + 1) is not None
    first, second = drain(log)
    assert first == BlockStored([request.block_hashes[0]], None, list(range(BS)), BS)
    assert second == BlockStored(request.block_hashes[1:3], request.block_hashes[0],
                                 list(range(BS, 3 * BS)), BS)
    check_chain(second, ("s",))


def test_prefix_hits_store_nothing() -> None:
    kv, log = with_log()
    a = make_request("a", list(range(2 * BS + 1)))
    admit(kv, a)
    drain(log)
    b = make_request("b", list(range(2 * BS + 1)))
    admit(kv, b)
    assert drain(log) == []


def test_a_duplicate_block_stores_nothing_and_splits_the_run() -> None:
    kv, log = with_log()
    a = make_request("a", list(range(BS + 1)))
    b = make_request("b", list(range(BS)) + [9] * BS + [1])
    hits_a, hits_b = kv.get_computed_blocks(a), kv.get_computed_blocks(b)  # both miss: computed twice
    assert kv.allocate(a, a.num_tokens, *hits_a) is not None
    assert kv.allocate(b, b.num_tokens, *hits_b) is not None
    events = drain(log)
    # b's first block has a's hash, which is indexed on a's copy: only b's second block is new
    assert events == [BlockStored([a.block_hashes[0]], None, list(range(BS)), BS),
                      BlockStored([b.block_hashes[1]], b.block_hashes[0], [9] * BS, BS)]
    assert b.block_hashes[0] == a.block_hashes[0]
    kv.free(b)  # b's anonymous copy is reused first: nothing cached is evicted
    admit(kv, make_request("c", [7] * (BS - 1)))
    assert drain(log) == []


def test_eviction_records_removed_hashes_in_eviction_order() -> None:
    kv, log = with_log(num_blocks=4)
    requests = [make_request(name, [10 * i + t for t in range(BS)]) for i, name in enumerate("abcd")]
    for request in requests:
        admit(kv, request)
        kv.free(request)
    drain(log)
    newcomer = make_request("e", list(range(100, 100 + 3 * BS)))
    admit(kv, newcomer, 2 * BS)  # one take of two blocks: one event, least recently used first
    hashes = [request.block_hashes[0] for request in requests]
    assert drain(log) == [BlockRemoved(hashes[:2]), BlockStored(newcomer.block_hashes[:2], None,
                                                                 newcomer.all_token_ids[:2 * BS], BS)]
    assert kv.allocate(newcomer, BS) is not None
    assert drain(log) == [BlockRemoved([hashes[2]]), BlockStored([newcomer.block_hashes[2]],
                                                                 newcomer.block_hashes[1],
                                                                 newcomer.all_token_ids[2 * BS:], BS)]
    assert kv.evictions == 3
    kv.check_invariants([newcomer])


def test_taking_anonymous_blocks_records_nothing() -> None:
    kv, log = with_log(num_blocks=4)
    a = make_request("a", list(range(BS - 1)))
    admit(kv, a)
    kv.free(a)
    admit(kv, make_request("b", list(range(50, 50 + BS - 1))))
    assert drain(log) == [] and log.next_seq == 0


def test_reset_prefix_cache_is_refused_while_blocks_are_referenced() -> None:
    kv, log = with_log()
    a = make_request("a", list(range(2 * BS + 1)))
    admit(kv, a)
    drain(log)
    before = index(kv)
    assert kv.reset_prefix_cache() is False
    assert index(kv) == before and log.num_pending == 0
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert drain(log) == [AllBlocksCleared()]
    assert index(kv) == set() and kv.pool.num_cached_free == 0 and kv.evictions == 0
    kv.check_invariants([])
    again = make_request("b", list(range(2 * BS + 1)))
    assert kv.get_computed_blocks(again) == ([], 0)
    admit(kv, again)  # the blocks are computed and stored again; their old copies evict nothing
    assert drain(log) == [BlockStored(again.block_hashes[:2], None, list(range(2 * BS)), BS)]
    kv.check_invariants([again])


def test_reset_without_a_log_and_without_caching() -> None:
    kv = KVCacheManager(4, BS, enable_caching=False)
    admit(kv, make_request("a", list(range(BS + 1))))
    assert kv.reset_prefix_cache() is False
    plain = KVCacheManager(4, BS)
    a = make_request("a", list(range(BS + 1)))
    admit(plain, a)
    plain.free(a)
    assert plain.reset_prefix_cache() is True and plain.pool.num_cached == 0
    plain.check_invariants([])


# ---- the log ---------------------------------------------------------------------------------------

def test_flush_numbers_only_non_empty_batches() -> None:
    log = KVEventLog()
    assert log.flush(5) is None and log.next_seq == 0
    log.record(BlockRemoved([1]))
    log.record(AllBlocksCleared())
    batch = log.flush(7)
    assert batch == KVEventBatch(0, 7, [BlockRemoved([1]), AllBlocksCleared()])
    assert log.flush(8) is None
    log.record(BlockRemoved([2]))
    assert log.flush(9) == KVEventBatch(1, 9, [BlockRemoved([2])]) and log.next_seq == 2
    assert log.num_pending == 0


def test_since_replays_the_ring_buffer_and_reports_gaps() -> None:
    log = KVEventLog(max_batches=3)
    assert log.since(0) == []
    for i in range(5):
        log.record(BlockRemoved([i]))
        log.flush(i)
    assert [b.seq for b in log.since(2) or []] == [2, 3, 4]
    assert [b.seq for b in log.since(4) or []] == [4]
    assert log.since(5) == []
    assert log.since(1) is None  # batch 1 fell out: the consumer must resync
    assert log.since(6) is None  # ahead of this log: it followed an earlier incarnation of the engine
    with pytest.raises(ValueError):
        log.since(-1)
    with pytest.raises(ValueError):
        KVEventLog(0)


def test_snapshot_groups_chains_and_names_its_sequence() -> None:
    kv, log = with_log(num_blocks=16)
    assert kv.pool.index_snapshot() == KVIndexSnapshot(-1, 0, [])
    a = make_request("a", list(range(3 * BS + 1)))
    b = make_request("b", [5] * (2 * BS + 1), salt="s")
    admit(kv, a)
    admit(kv, b)
    log.flush(1)
    snap = kv.pool.index_snapshot(ts_ns=2)
    assert snap.seq == 0 and snap.ts_ns == 2
    assert snap.events == [BlockStored(a.block_hashes[:3], None, list(range(3 * BS)), BS),
                           BlockStored(b.block_hashes[:2], None, [5] * (2 * BS), BS)]
    mirror = KVIndexMirror()
    mirror.resync(snap)
    assert mirror.hashes == index(kv) and mirror.next_seq == 1 and not mirror.stale
    with pytest.raises(ValueError):
        KVCacheManager(4, BS).pool.index_snapshot()  # a pool without a log


def test_snapshot_with_pending_events_then_the_next_batch_is_exact() -> None:
    kv, log = with_log(num_blocks=3)
    a = make_request("a", list(range(3 * BS)))
    admit(kv, a, 3 * BS)
    kv.free(a)
    log.flush(0)
    # pending: a's blocks evicted, new ones stored, one of them with a's first block's content again
    b = make_request("b", list(range(BS)) + [8] * (2 * BS))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == BS
    assert kv.allocate(b, 2 * BS, hits, num_hit) is not None
    assert log.num_pending == 2
    snap = kv.pool.index_snapshot()
    assert snap.seq == 0  # the pending events are in it already, and come again in batch 1
    batch = log.flush(1)
    assert batch is not None and batch.seq == 1
    mirror = KVIndexMirror()
    mirror.resync(snap)
    assert mirror.apply(batch) and mirror.hashes == index(kv)


# ---- the mirror ------------------------------------------------------------------------------------

def test_mirror_ignores_duplicates_detects_gaps_and_recovers_by_replay() -> None:
    batches = [KVEventBatch(0, 0, [BlockStored([1, 2], None, [0] * 8, 4)]),
               KVEventBatch(1, 0, [BlockRemoved([2])]),
               KVEventBatch(2, 0, [BlockStored([3], 1, [0] * 4, 4)]),
               KVEventBatch(3, 0, [AllBlocksCleared(), BlockStored([7], None, [1] * 4, 4)])]
    mirror = KVIndexMirror()
    assert mirror.apply(batches[0]) and mirror.hashes == {1, 2}
    assert mirror.apply(batches[0]) and mirror.hashes == {1, 2}  # a duplicate changes nothing
    assert not mirror.apply(batches[2]) and mirror.stale and mirror.hashes == {1, 2}
    assert mirror.apply(batches[1]) and not mirror.stale and mirror.next_seq == 2
    assert mirror.apply(batches[2]) and mirror.hashes == {1, 3}
    assert mirror.longest_prefix([1, 3, 4]) == 2 and mirror.longest_prefix([3, 1]) == 2
    assert mirror.longest_prefix([2, 1]) == 0 and mirror.longest_prefix([]) == 0
    assert mirror.apply(batches[3]) and mirror.hashes == {7} and mirror.next_seq == 4
    with pytest.raises(TypeError):
        mirror.apply(KVEventBatch(4, 0, ["stored"]))  # type: ignore[list-item]


def test_wire_form_is_plain_lists_and_round_trips() -> None:
    batch = KVEventBatch(3, 99, [BlockStored([1, 2**63], None, [5] * 8, 4), BlockRemoved([4]),
                                 AllBlocksCleared(), BlockStored([6], 1, [0] * 4, 4)])
    wire = json.loads(json.dumps(batch_to_wire(batch)))
    assert batch_from_wire(wire) == batch
    with pytest.raises(ValueError):
        batch_from_wire([0, 0, [["nope"]]])


# ---- randomized: the mirrors stay exact over random workloads --------------------------------------

class KVEventsMachine(RuleBasedStateMachine):
    """Random admissions, chunked growth, decode, frees and prefix-cache resets on a small pool, with a log
    attached. After every operation: an in-order consumer, a strict replay from sequence 0 (while the
    buffer holds it) and a snapshot each rebuild exactly the pool's hash index; a lossy consumer that
    drops batches notices the gap and is exact again after replay or resync; a lagging consumer catches
    up by `since` or by snapshot. A twin manager without a log makes the same decisions."""

    @initialize(num_blocks=st.integers(2, 8), max_batches=st.sampled_from([1, 2, 3, 1_000_000]))
    def setup(self, num_blocks: int, max_batches: int) -> None:
        self.log = KVEventLog(max_batches)
        self.kv = KVCacheManager(num_blocks, BS, events=self.log)
        self.twin = KVCacheManager(num_blocks, BS)
        self.live: dict[str, Request] = {}
        self.next_id = 0
        self.ts = 0
        self.batches: list[KVEventBatch] = []
        self.in_order = KVIndexMirror()
        self.lossy = KVIndexMirror()
        self.lossy_missed = False
        self.lagger = KVIndexMirror()

    # ---- operations ----

    def _allocate(self, request: Request, n: int, hits: list[KVBlock] = (), num_hit: int = 0) -> bool:
        twin_hits = [self.twin.pool.blocks[b.block_id] for b in hits]
        new = self.kv.allocate(request, n, hits, num_hit)
        twin_new = self.twin.allocate(request, n, twin_hits, num_hit)
        assert (new is None) == (twin_new is None)
        if new is None:
            return False
        assert [b.block_id for b in new] == [b.block_id for b in twin_new or []]
        request.num_computed_tokens += num_hit + n
        return True

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9] * 12]),
          tail=st.lists(st.integers(0, 2), min_size=1, max_size=14), salt=st.sampled_from(SALTS),
          chunk=st.integers(1, 12), data=st.data())
    def admit(self, prefix: list[int], tail: list[int], salt: str | None, chunk: int,
              data: st.DataObject) -> None:
        request = make_request(f"r{self.next_id}", prefix + tail, salt)
        self.next_id += 1
        hits, num_hit = self.kv.get_computed_blocks(request)
        assert [b.block_id for b in hits] == [b.block_id for b in self.twin.get_computed_blocks(request)[0]]
        if self._allocate(request, min(chunk, request.num_tokens - num_hit), hits, num_hit):
            self.live[request.request_id] = request
        self._after(data)

    @rule(prefix=st.sampled_from([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
          tail=st.lists(st.integers(0, 2), min_size=1, max_size=6), salt=st.sampled_from(SALTS),
          data=st.data())
    def admit_pair(self, prefix: list[int], tail: list[int], salt: str | None, data: st.DataObject) -> None:
        """Two requests with one prompt admitted in one step: both look up before either computes, so the
        second computes the same blocks again and its copies must stay out of the index and the events."""
        pair = [make_request(f"r{self.next_id + i}", prefix + tail, salt) for i in range(2)]
        self.next_id += 2
        # Identical prompts find identical hits, which the first allocation references: still valid for
        # the second, as `get_computed_blocks` requires.
        lookups = [self.kv.get_computed_blocks(request) for request in pair]
        for request in pair:
            self.twin.get_computed_blocks(request)
        for request, (hits, num_hit) in zip(pair, lookups):
            if self._allocate(request, request.num_tokens - num_hit, hits, num_hit):
                self.live[request.request_id] = request
            else:
                break  # the pool is short: the second may not allocate after the first failed either
        self._after(data)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 12), token=st.integers(0, 2))
    def grow(self, data: st.DataObject, chunk: int, token: int) -> None:
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(token)  # caught up: "sample" a token, then compute it
        self._allocate(request, min(chunk, request.num_tokens - request.num_computed_tokens))
        self._after(data)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), free_all=st.integers(0, 5), then_reset=st.integers(0, 5))
    def free(self, data: st.DataObject, free_all: int, then_reset: int) -> None:
        """Free one request (or, now and then, all of them), and now and then reset the prefix cache:
        rarely enough that evictions still happen, and both while others are live and when none is."""
        chosen = sorted(self.live) if free_all == 0 else [data.draw(st.sampled_from(sorted(self.live)))]
        for request_id in chosen:
            request = self.live.pop(request_id)
            self.kv.free(request)
            self.twin.free(request)
        if then_reset == 0:
            assert self.kv.reset_prefix_cache() is (not self.live)
            assert self.twin.reset_prefix_cache() is (not self.live)
        self._after(data)

    @rule()
    def catch_up(self) -> None:
        """The lagging consumer asks for everything since it last looked."""
        batches = self.log.since(self.lagger.next_seq)
        oldest_kept = max(0, self.log.next_seq - self.log.max_batches)
        assert (batches is None) == (self.lagger.next_seq < oldest_kept)
        if batches is None:
            note_event("lagger resynced from a snapshot")
            snap = self.kv.pool.index_snapshot(self.ts)
            assert snap.seq == self.log.next_seq - 1
            self.lagger.resync(snap)
            batches = self.log.since(snap.seq + 1)
            assert batches == []  # nothing is pending between operations
        for batch in batches:
            assert self.lagger.apply(batch)
        assert self.lagger.hashes == index(self.kv)

    # ---- checks after every operation ----

    def _after(self, data: st.DataObject) -> None:
        truth = index(self.kv)
        early = None
        if self.lossy_missed and self.log.num_pending and data.draw(st.booleans(), label="resync early"):
            early = self.kv.pool.index_snapshot(self.ts)  # taken with this operation's events pending
        self.ts += 1
        batch = self.log.flush(self.ts)
        if batch is not None:
            self.batches.append(batch)
            assert batch.seq == len(self.batches) - 1
            assert self.in_order.apply(batch)
        assert self.in_order.hashes == truth
        self._check_replay_from_zero(truth)
        self._check_snapshot(truth)
        if batch is not None:
            for kind in {type(e).__name__ for e in batch.events}:
                note_event(f"recorded {kind}")
        if early is not None:
            note_event("lossy resynced with events pending")
            self.lossy.resync(early)
            assert batch is not None and self.lossy.apply(batch)
            self.lossy_missed = False
            assert self.lossy.hashes == truth
        elif batch is not None:
            if data.draw(st.booleans(), label="drop"):
                self.lossy_missed = True
            elif self.lossy.apply(batch):
                assert not self.lossy_missed and self.lossy.hashes == truth
            else:
                assert self.lossy_missed and self.lossy.stale
                self._recover_lossy(truth)
        self.kv.check_invariants(self.live.values())
        assert [(b.ref_cnt, b.block_hash) for b in self.kv.pool.blocks] == \
            [(b.ref_cnt, b.block_hash) for b in self.twin.pool.blocks]
        assert [b.block_id for b in self.kv.pool.free_queue] == \
            [b.block_id for b in self.twin.pool.free_queue]

    def _check_replay_from_zero(self, truth: set[int]) -> None:
        replay = self.log.since(0)
        assert (replay is None) == (self.log.next_seq > self.log.max_batches)
        if replay is not None:
            assert replay == self.batches
            assert strict_replay(replay) == truth
            fresh = KVIndexMirror()
            assert all(fresh.apply(batch) for batch in replay) and fresh.hashes == truth

    def _check_snapshot(self, truth: set[int]) -> None:
        snap = self.kv.pool.index_snapshot(self.ts)
        assert snap.seq == self.log.next_seq - 1
        stored = [h for event in snap.events for h in event.block_hashes]
        assert len(stored) == len(set(stored)) and set(stored) == truth
        for event in snap.events:
            check_chain(event)

    def _recover_lossy(self, truth: set[int]) -> None:
        batches = self.log.since(self.lossy.next_seq)
        note_event("lossy recovered by " + ("replay" if batches is not None else "snapshot"))
        if batches is None:
            snap = self.kv.pool.index_snapshot(self.ts)
            self.lossy.resync(snap)
            batches = self.log.since(snap.seq + 1)
        assert batches is not None
        for batch in batches:
            assert self.lossy.apply(batch)
        assert not self.lossy.stale and self.lossy.hashes == truth
        self.lossy_missed = False


TestKVEventsMachine = KVEventsMachine.TestCase
TestKVEventsMachine.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
