"""KV groups (docs/kv-groups.md): one block table per group over one pool; sliding groups release what
their window has passed. State machines over a full + full and a full + sliding spec."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from tests.core.test_kv_cache import KVCacheMachine
from tokenloop.config import KVGroup, ModelConfig
from tokenloop.core.kv_cache import KVCacheManager
from tokenloop.core.kv_events import BlockStored, KVEventLog, KVIndexMirror
from tokenloop.request import Request, SamplingParams

BS = 4
SPECS = {
    "full+full": (KVGroup("full"), KVGroup("full")),
    "full+sliding5": (KVGroup("full"), KVGroup("sliding", 5)),
    "full+sliding8+sliding8": (KVGroup("full"), KVGroup("sliding", 8), KVGroup("sliding", 8)),
}


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=8), 0)


class KVGroupsMachine(KVCacheMachine):
    """The KV cache machine's admissions (prefix hits across groups), growth and frees over several groups.
    After each rule the pool is consistent (free + referenced = total, refcounts = table entries per group),
    every block a request's next query reads in each group holds that request's tokens, no block a live
    window covers was ever released or re-taken (its table entry is still the block that was written), and
    a freed request holds nothing in any group."""

    @initialize(num_blocks=st.integers(4, 24), spec=st.sampled_from(sorted(SPECS)))
    def setup(self, num_blocks: int, spec: str) -> None:  # type: ignore[override]
        self.kv = KVCacheManager(num_blocks, BS, True, KVEventLog(), groups=SPECS[spec])
        self.live: dict[str, Request] = {}
        self.contents: dict[int, list[int | None]] = {i: [None] * BS for i in range(num_blocks)}
        self.written: dict[tuple[str, int, int], int] = {}  # (request, group, position) -> block id written
        self.next_id = 0

    def _first_read(self, group: int, num_computed: int) -> int:
        spec = self.kv.groups[group]
        return self.kv.first_live_block(num_computed, spec.window) if spec.kind == "sliding" else 0

    def _write_and_check(self, request: Request, start: int, end: int) -> None:
        admission = all(key[0] != request.request_id for key in self.written)
        for group in range(self.kv.num_groups):
            table = self.kv.get_block_ids(request.request_id, group)
            assert len(table) * BS >= end
            if admission:
                # An admission: a prefix hit's blocks hold what its next query reads.
                for pos in range(self._first_read(group, start) * BS, start):
                    assert self.contents[table[pos // BS]][pos % BS] == request.all_token_ids[pos]
                    self.written[request.request_id, group, pos // BS] = table[pos // BS]
            for pos in range(start, end):
                block_id = table[pos // BS]
                assert block_id >= 0, "a position this step computes was released"
                self.contents[block_id][pos % BS] = request.all_token_ids[pos]
                self.written[request.request_id, group, pos // BS] = block_id
            # What the next query reads: every key for a full group, its window's blocks for a sliding one.
            for pos in range(self._first_read(group, end) * BS, end):
                assert self.contents[table[pos // BS]][pos % BS] == request.all_token_ids[pos]

    @invariant()
    def windows_kept(self) -> None:
        if not hasattr(self, "kv"):
            return
        pool = self.kv.pool
        referenced = sum(1 for block in pool.blocks if block.ref_cnt > 0)
        assert pool.num_free + referenced == pool.num_blocks
        for request_id in {key[0] for key in self.written} - set(self.live):  # freed: nothing left anywhere
            assert self.kv.num_blocks_referenced(request_id) == 0
            assert all(self.kv.get_block_ids(request_id, g) == [] for g in range(self.kv.num_groups))
        self.written = {key: block for key, block in self.written.items() if key[0] in self.live}
        for request in self.live.values():
            for group in range(self.kv.num_groups):
                table = self.kv.get_block_ids(request.request_id, group)
                for position in range(self._first_read(group, request.num_computed_tokens),
                                      self.kv.num_blocks_for(request.num_computed_tokens)):
                    # A block the live window covers: never released, never swapped for another.
                    assert table[position] == self.written[request.request_id, group, position] >= 0
                    assert pool.blocks[table[position]].ref_cnt > 0


TestKVGroupsMachine = KVGroupsMachine.TestCase
TestKVGroupsMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def _grow(kv: KVCacheManager, request: Request, total: int, chunk: int) -> None:
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate(request, min(chunk, total - num_hit), hits, num_hit) is not None
    request.num_computed_tokens = num_hit + min(chunk, total - num_hit)
    while request.num_computed_tokens < total:
        n = min(chunk, total - request.num_computed_tokens)
        assert kv.allocate(request, n) is not None
        request.num_computed_tokens += n


def test_a_sliding_group_holds_at_most_its_window_and_a_step() -> None:
    kv = KVCacheManager(64, BS, groups=(KVGroup("full"), KVGroup("sliding", 8)))
    request = make_request("long", list(range(120)))
    _grow(kv, request, 100, chunk=3)
    held = [sum(1 for b in kv.get_block_ids("long", g) if b >= 0) for g in range(2)]
    assert held[0] == 25  # every block of 100 tokens
    # The next query (at 100) sees 93..100: blocks 23 and 24, plus room for one more step's tokens.
    assert held[1] <= kv.num_blocks_for(8 - 1 + 3) + 1 and held[1] == 2
    assert kv.blocks_to_hold(100, 3) == 25 + kv.num_blocks_for(10) + 1
    kv.free(request)
    assert kv.num_blocks_referenced("long") == 0 and kv.num_free_blocks == 64


def test_a_prefix_hit_is_the_longest_every_group_can_serve() -> None:
    kv = KVCacheManager(64, BS, groups=(KVGroup("full"), KVGroup("sliding", 5)))
    first = make_request("a", list(range(40)))
    _grow(kv, first, 40, chunk=40)
    kv.free(first)
    again = make_request("b", list(range(40)) + [99])
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 40  # every block of every group is still cached
    # Evict the sliding group's block 9 (tokens 36..39): a hit at 40 needs it (the query at 40 sees 36..40);
    # a hit at 36 needs only block 8 (the query at 36 sees 32..36), so the hit shrinks to 36.
    sliding = kv.pool.lookup(again.block_hashes[9], 1)
    assert sliding is not None
    kv.pool.free_queue.remove(sliding)
    kv.pool.free_queue.appendleft(sliding)
    kv.pool.take(1, 0)
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 36
    assert kv.allocate(again, again.num_tokens - num_hit, hits, num_hit) is not None
    assert kv.get_block_ids("b", 1)[:kv.first_live_block(36, 5)] == [-1] * 8


def test_events_name_the_group_and_the_router_mirror_keeps_group_0() -> None:
    log = KVEventLog()
    kv = KVCacheManager(16, BS, events=log, groups=(KVGroup("full"), KVGroup("sliding", 5)))
    request = make_request("a", list(range(9)))
    _grow(kv, request, 9, chunk=9)
    batch = log.flush(0)
    assert batch is not None
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert sorted(e.group for e in stored) == [0, 1] and all(e.block_hashes == stored[0].block_hashes
                                                            for e in stored)
    mirror = KVIndexMirror()
    mirror.apply(batch)
    assert mirror.hashes == {h for h, _ in kv.pool.cached_items(0)}
    snapshot = kv.pool.index_snapshot()
    assert sorted(e.group for e in snapshot.events) == [0, 1]


_GEMMA_270M = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18))


@pytest.mark.parametrize(("layer_types", "expected"), [
    ((), [("full", (0, 1, 2, 3, 4, 5))]),
    (_GEMMA_270M[:12], [("full", (5, 11)), ("sliding", (0, 1)), ("sliding", (2, 3)), ("sliding", (4, 6)),
                        ("sliding", (7, 8)), ("sliding", (9, 10))]),
    (_GEMMA_270M, [("full", (5, 11, 17)), ("sliding", (0, 1, 2)), ("sliding", (3, 4, 6)),
                   ("sliding", (7, 8, 9)), ("sliding", (10, 12, 13)), ("sliding", (14, 15, 16))]),
])
def test_model_layers_split_into_equal_groups(layer_types: tuple[str, ...], expected: list) -> None:
    config = ModelConfig(architecture="gemma3", vocab_size=8, hidden_size=8, intermediate_size=8,
                         num_layers=len(layer_types) or 6, num_heads=1, num_kv_heads=1, head_dim=8,
                         max_position_embeddings=64, layer_types=layer_types,
                         sliding_window=4 if layer_types else 0)
    assert [(g.kind, g.layers) for g in config.kv_groups()] == expected
