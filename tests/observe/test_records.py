"""The observer contract: the engine's records alone reconcile with the engine, and observers hold no engine.

A recording observer replays every StepRecord, ArrivalRecord and ReleaseInfo of a workload with
preemption (a small pool), prefix hits, aborts (queued and running) and n>1: tokens scheduled, blocks
taken and given back, requests ended and tokens sampled all add up to what the engine itself reports.
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from dataclasses import dataclass, field

from tests.tracing.conftest import PROMPTS, make_engine
from tokenloop.core.engine_core import EngineCore
from tokenloop.core.kv_cache import KVCacheManager
from tokenloop.core.scheduler import Scheduler
from tokenloop.engine import LLMEngine
from tokenloop.model.loader import Checkpoint
from tokenloop.observe.metrics import EngineMetrics
from tokenloop.observe.records import (
    ArrivalRecord,
    EngineObserver,
    ReleaseInfo,
    StepRecord,
)
from tokenloop.observe.tracer import Tracer
from tokenloop.outputs import RequestOutput
from tokenloop.request import SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@dataclass
class Replay(EngineObserver):
    """Rebuilds the pool's refcounts and every request's block table from grants, preemptions and releases."""

    num_blocks: int
    refs: Counter[int] = field(default_factory=Counter)
    tables: dict[str, list[int]] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)
    arrivals: list[str] = field(default_factory=list)
    releases: list[ReleaseInfo] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    sampled: dict[str, list[int]] = field(default_factory=dict)

    def on_arrival(self, record: ArrivalRecord) -> None:
        assert record.request_id not in self.live
        self.arrivals.append(record.request_id)
        self.live.add(record.request_id)

    def on_step(self, record: StepRecord) -> None:
        assert not self.steps or record.start_ns >= self.steps[-1].end_ns
        self.steps.append(record)
        assert sum(c.num_tokens for c in record.scheduled) == record.num_batched_tokens
        assert sum(record.stage_ns().values()) == record.end_ns - record.start_ns
        for request_id in record.preempted:  # recompute: its whole table goes back
            self._drop(self.tables.pop(request_id))
        for chunk in record.scheduled:
            assert chunk.request_id in self.live
            if chunk.admitted:
                assert chunk.request_id not in self.tables
                self.tables[chunk.request_id] = []
            for block_id in chunk.allocated_block_ids:
                assert self.refs[block_id] == 0, "a block taken from the free queue was still referenced"
            for block_id in chunk.new_block_ids:
                self.refs[block_id] += 1
            self.tables[chunk.request_id].extend(chunk.new_block_ids)
            assert len(self.tables[chunk.request_id]) == chunk.num_blocks
        assert len(record.sampled_ids) == len(record.sampled_tokens)
        for request_id, token in zip(record.sampled_ids, record.sampled_tokens):
            self.sampled.setdefault(request_id, []).append(token)
        self._release(record.releases)
        g = record.gauges
        assert self.num_free() == g.num_free_blocks, "replayed grants and releases disagree with the pool"
        assert g.num_running + g.num_waiting == len(self.live)
        assert g.num_preemptions == sum(len(s.preempted) for s in self.steps)

    def on_release(self, records: list[ReleaseInfo]) -> None:
        self._release(records)

    def _release(self, infos: list[ReleaseInfo]) -> None:
        for info in infos:
            assert info.request_id in self.live
            self.live.remove(info.request_id)
            table = self.tables.pop(info.request_id, [])
            assert info.block_ids == table
            self._drop(table)
            still = sum(1 for b in table if self.refs[b] > 0)
            assert info.num_still_shared == still
            assert info.num_freed + info.num_kept_cached + info.num_still_shared == len(table)
            self.releases.append(info)

    def _drop(self, table: list[int]) -> None:
        for block_id in table:
            assert self.refs[block_id] > 0
            self.refs[block_id] -= 1

    def num_free(self) -> int:
        return self.num_blocks - sum(1 for n in self.refs.values() if n > 0)


def _workload(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Five prompts on a small pool, one of them n=2, a repeated prompt, a queued and a running abort."""
    finals: dict[str, RequestOutput] = {}

    def keep(outputs: list[RequestOutput]) -> None:
        finals.update({o.request_id: o for o in outputs if o.finished})

    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=24,
                                                           ignore_eos=True) if i == 1 else LONG)
    engine.add_request("queued-abort", PROMPTS[0], LONG)
    keep(engine.abort_request("queued-abort"))
    running_aborted = False
    while engine.has_unfinished_requests():
        keep(engine.step())
        request = engine.scheduler.get_request("r4")
        if not running_aborted and request is not None and request.num_output_tokens >= 2:
            keep(engine.abort_request("r4"))
            running_aborted = True
    assert running_aborted
    engine.add_request("again", PROMPTS[2], LONG)  # its prompt blocks are cached: a prefix hit
    while engine.has_unfinished_requests():
        keep(engine.step())
    return finals


def test_records_reconcile_with_the_engine(tiny: Checkpoint) -> None:
    replay = Replay(num_blocks=24)
    engine = make_engine(tiny, num_blocks=24, max_num_batched_tokens=16)
    engine.add_observer(replay)
    finals = _workload(engine)

    assert engine.stats().num_preemptions > 0 and any(s.preempted for s in replay.steps)
    assert any(c.num_reused_blocks > 0 and c.prefix_hit_tokens > 0 for s in replay.steps for c in s.scheduled)
    assert len([s for s in replay.steps if s.scheduled]) == engine.num_steps
    # Blocks: everything given back at the end, and the pool agrees.
    assert replay.num_free() == engine.kv_cache.num_free_blocks == 24
    engine.kv_cache.check_invariants([])
    # Requests: one release per core request that arrived; the same ends as the user-facing outputs.
    assert not replay.live and sorted(replay.arrivals) == sorted(r.request_id for r in replay.releases)
    completions = [c for o in finals.values() for c in o.outputs]
    assert len(completions) == len(replay.releases) == len(PROMPTS) + 3  # n=2, queued abort, "again"
    assert Counter(c.finish_reason for c in completions) == Counter(r.finish_reason for r in replay.releases)
    assert Counter(r.finish_reason for r in replay.releases) == {"length": len(PROMPTS) + 1, "abort": 2}
    # Tokens: what the records sampled is what each sample generated, in order.
    for output in finals.values():
        core_ids = [output.request_id] if len(output.outputs) == 1 else [
            f"{output.request_id}#{c.index}" for c in output.outputs]
        for core_id, completion in zip(core_ids, output.outputs):
            assert replay.sampled.get(core_id, []) == list(completion.token_ids), core_id
    by_id = {r.request_id: r for r in replay.releases}
    for core_id, tokens in replay.sampled.items():
        assert by_id[core_id].num_output_tokens == len(tokens)
    assert sum(len(s.sampled_tokens) for s in replay.steps) == sum(len(c.token_ids) for c in completions)


def _holds_engine(root: object, limit: int = 200_000) -> str | None:
    """Walk everything reachable from `root` (modules and types excluded); name an engine part found."""
    forbidden = (LLMEngine, EngineCore, Scheduler, KVCacheManager)
    seen: set[int] = set()
    stack = [root]
    while stack and len(seen) < limit:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, str, bytes, int, float, type(gc))):
            continue
        seen.add(id(obj))
        if isinstance(obj, forbidden):
            return type(obj).__name__
        stack.extend(gc.get_referents(obj))
    return None


def test_observers_hold_no_engine(tiny: Checkpoint) -> None:
    tracer, metrics = Tracer(sample_rate=0.5, seed=1), EngineMetrics("tiny")
    engine = make_engine(tiny, tracer, num_blocks=24, max_num_batched_tokens=16)
    engine.add_observer(metrics)
    _workload(engine)
    assert _holds_engine(tracer) is None and _holds_engine(metrics) is None
    gone = weakref.ref(engine)
    num_steps = engine.num_steps
    del engine
    gc.collect()
    assert gone() is None, "something still holds the engine"
    # Everything still exports from the tracer's own data.
    ids = tracer.request_ids()
    assert 0 < len(ids) < len(PROMPTS) + 3  # sampled for detail: some, not all
    assert tracer.totals["finished"] + tracer.totals["aborted"] == len(PROMPTS) + 3
    assert len(tracer.summaries) == len(PROMPTS) + 3  # summaries cover the unsampled requests too
    assert tracer.chrome_trace()["traceEvents"]
    assert tracer.mechanism(ids[0])["scenarios"][0]["steps"]
    state = tracer.dashboard_state()
    assert state["counters"]["steps"] == num_steps and state["counters"]["running"] == 0
    assert state["kv"]["referenced"] == 0 and len(state["ttft"]) == len(PROMPTS) + 2
    assert b"tokenloop:kv_cache_usage_perc" in metrics.render()


def test_metrics_gauges_follow_records_between_steps(tiny: Checkpoint) -> None:
    """An arrival and an abort on an idle engine take no step: the gauges still move (from the records)."""
    from tests.serving.conftest import metric_value

    metrics = EngineMetrics("tiny")
    engine = make_engine(tiny, num_blocks=24)
    engine.add_observer(metrics)

    def value(name: str) -> float:
        return metric_value(metrics.render().decode(), f"tokenloop:{name}")

    engine.add_request("a", PROMPTS[2], LONG)
    assert value("num_requests_waiting") == 1
    engine.abort_request("a")  # before any step
    assert value("num_requests_waiting") == 0
    engine.add_request("b", PROMPTS[2], LONG)
    engine.add_request("c", PROMPTS[0], LONG)
    for _ in range(3):
        engine.step()
    assert value("num_requests_running") == 2 and value("kv_cache_usage_perc") > 0
    generated = sum(engine.scheduler.get_request(r).num_output_tokens for r in ("b", "c"))
    assert value("generation_tokens_total") == generated > 0 and value("iteration_tokens_count") == 3
    engine.abort_request(["b", "c"])  # between steps, and no step follows
    assert value("num_requests_running") == 0 and value("num_requests_waiting") == 0
    assert value("kv_cache_usage_perc") == 0.0
    assert value("prefix_cache_queries_total") == engine.kv_cache.prefix_cache_queries
