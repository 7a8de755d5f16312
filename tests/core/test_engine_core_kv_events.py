"""The engine core's KV events: each step's batch, applied in order, mirrors the pool's prefix index."""

from __future__ import annotations

from tests.conftest import TINY_PROMPTS
from tokenloop.core.engine_core import EngineCore
from tokenloop.core.kv_events import KVIndexMirror
from tokenloop.core.messages import CoreRequest
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint
from tokenloop.request import SamplingParams


def _core(tiny: Checkpoint, **options: object) -> EngineCore:
    config = build_engine_config(str(tiny.path), block_size=4, num_blocks=40, max_num_seqs=4,
                                 max_num_batched_tokens=32, enable_kv_events=True, **options)
    return EngineCore(config, checkpoint=tiny)


def _index(core: EngineCore) -> set[int]:
    return {block_hash for block_hash, _ in core.kv_cache.pool.cached_items()}


def test_step_batches_mirror_the_index_through_evictions_and_aborts(tiny: Checkpoint) -> None:
    core = _core(tiny)
    tokenizer = tiny.tokenizer
    mirror = KVIndexMirror()
    shared = tokenizer.encode(TINY_PROMPTS[0])
    prompts = [shared + tokenizer.encode(p) for p in TINY_PROMPTS] * 3  # shared prefixes, and a small pool
    for i, ids in enumerate(prompts):
        core.add_requests([CoreRequest(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=6,
                                                                    ignore_eos=True), 0)])
    steps = 0
    while core.has_unfinished_requests():
        out = core.step()
        steps += 1
        if out.kv_events is not None:
            assert mirror.apply(out.kv_events)
        if steps == 3:
            core.finish_requests(["r1", "r2"])  # aborts release blocks between steps
        assert mirror.hashes == _index(core)
    assert core.kv_cache.evictions > 0, "the workload should evict cached blocks"
    # A late consumer replays the log from sequence 0 and gets the same index.
    late = KVIndexMirror()
    batches = core.kv_events_since(0)
    assert batches is not None
    for batch in batches:
        assert late.apply(batch)
    assert late.hashes == _index(core)
    snapshot = core.kv_snapshot()
    resynced = KVIndexMirror()
    resynced.resync(snapshot)
    assert resynced.hashes == _index(core)


def test_events_off_publish_nothing(tiny: Checkpoint) -> None:
    config = build_engine_config(str(tiny.path), block_size=4, num_blocks=24)
    core = EngineCore(config, checkpoint=tiny)
    core.add_requests([CoreRequest("a", tiny.tokenizer.encode("hello world"), SamplingParams(max_tokens=2), 0)])
    out = core.step()
    assert out.kv_events is None and core.kv_events_since(0) is None and core.kv_snapshot() is None
