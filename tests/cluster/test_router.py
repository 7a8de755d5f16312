"""Routers and the load tracker: exact block hashes, KV mirrors through gaps, each policy's choices."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import TINY_PROMPTS
from tokenloop.cluster.load import LoadTracker, ReplicaLoad
from tokenloop.cluster.router import (
    ROUTERS,
    CostRouter,
    Dispatcher,
    NoReplicaError,
    RouterConfig,
    RouteRequest,
    make_router,
    predicted_ttft_s,
    prompt_block_hashes,
)
from tokenloop.cluster.step_costs import DEFAULT_STEP_COSTS, StepCostFit, StepCosts
from tokenloop.core.engine_core import EngineCore
from tokenloop.core.kv_events import KVIndexMirror
from tokenloop.core.messages import CoreRequest
from tokenloop.errors import InvalidRequestError
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint
from tokenloop.observe.records import EngineObserver
from tokenloop.request import SamplingParams

BS = 4
COSTS = StepCosts(step_s=0.010, prefill_token_s=0.001, decode_row_s=0.0005)


def _core(tiny: Checkpoint, num_blocks: int = 40) -> EngineCore:
    config = build_engine_config(str(tiny.path), block_size=BS, num_blocks=num_blocks, max_num_seqs=4,
                                 max_num_batched_tokens=32, enable_kv_events=True)
    # An observer makes the core build its step records (the tracker reads their gauges).
    return EngineCore(config, checkpoint=tiny, observers=[EngineObserver()])


def _index(core: EngineCore) -> set[int]:
    return {block_hash for block_hash, _ in core.kv_cache.pool.cached_items()}


def _params(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _load(index: int, *, running: int = 0, waiting: int = 0, queued: int = 0, hashes: set[int] = frozenset(),
          alive: bool = True, admitting: bool = True, costs: StepCosts = COSTS) -> ReplicaLoad:
    mirror = KVIndexMirror()
    mirror.hashes.update(hashes)
    return ReplicaLoad(index, alive, admitting, running, waiting, queued, costs, mirror, 0.0, True)


def _prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# ---- exact hashes: router and engine agree ---------------------------------------------------------

@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_router_and_engine_compute_the_same_block_hashes(tiny: Checkpoint, salt: str | None) -> None:
    core = _core(tiny)
    ids = tiny.tokenizer.encode(TINY_PROMPTS[2])
    assert len(ids) >= 3 * BS
    core.add_requests([CoreRequest("r", ids, _params(), 0, cache_salt=salt)])
    mirror = KVIndexMirror()
    while core.has_unfinished_requests():
        out = core.step()
        if out.kv_events is not None:
            assert mirror.apply(out.kv_events)
    hashes = prompt_block_hashes(RouteRequest("q", ids, cache_salt=salt), BS)
    assert len(hashes) == len(ids) // BS
    assert all(core.kv_cache.pool.lookup(h) is not None for h in hashes)
    assert mirror.longest_prefix(hashes) == len(hashes)
    other = prompt_block_hashes(RouteRequest("q", ids, cache_salt="other" if salt else "x"), BS)
    assert mirror.longest_prefix(other) == 0  # another salt shares nothing
    # The engine's own prefix lookup finds what the router predicted.
    core.add_requests([CoreRequest("again", ids, _params(1), 0, cache_salt=salt)])
    out = core.step()
    chunk = next(c for c in out.record.scheduled if c.request_id == "again")
    expected = min(len(hashes), (len(ids) - 1) // BS) * BS
    assert chunk.prefix_hit_tokens == expected


# ---- KV-event streams with gaps, replayed or resynced, equal the engine's index -----------------------

@settings(max_examples=12, deadline=None)
@given(drops=st.lists(st.booleans(), min_size=40, max_size=40),
       use_snapshot=st.lists(st.booleans(), min_size=40, max_size=40),
       order=st.permutations(range(len(TINY_PROMPTS))))
def test_event_gaps_are_detected_and_resynced_into_the_engines_index(tiny: Checkpoint, drops: list[bool],
                                                                    use_snapshot: list[bool],
                                                                    order: list[int]) -> None:
    core = _core(tiny, num_blocks=28)  # small: the workload evicts
    tracker = LoadTracker(1, BS)
    shared = tiny.tokenizer.encode(TINY_PROMPTS[1])
    for i, p in enumerate(order * 2):
        core.add_requests([CoreRequest(f"r{i}", shared + tiny.tokenizer.encode(TINY_PROMPTS[p]), _params(5), 0)])
    step = 0
    while core.has_unfinished_requests():
        out = core.step()
        if drops[step % len(drops)] and out.kv_events is not None:
            out = dataclasses.replace(out, kv_events=None)  # lost on the way
        elif out.kv_events is not None:
            tracker.on_frame(0, out)
            if tracker.needs_resync(0):  # a later batch revealed the gap: the lead's call, made here
                replay = core.kv_events_since(tracker.mirror(0).next_seq)
                if use_snapshot[step % len(use_snapshot)] or replay is None:
                    snapshot = core.kv_snapshot()
                    tracker.resync(0, snapshot, core.kv_events_since(snapshot.seq + 1) or [])
                else:
                    assert tracker.catch_up(0, replay)
                assert not tracker.needs_resync(0)
                assert tracker.mirror(0).hashes == _index(core)
        step += 1
    replay = core.kv_events_since(tracker.mirror(0).next_seq)
    assert replay is not None
    tracker.catch_up(0, replay)
    assert tracker.mirror(0).hashes == _index(core)
    assert core.kv_cache.evictions > 0


def test_a_mirror_without_events_goes_untrusted_and_the_estimate_takes_over(tiny: Checkpoint) -> None:
    now = [0]
    tracker = LoadTracker(1, BS, max_staleness_s=1.0, clock=lambda: now[0])
    core = _core(tiny)
    ids = tiny.tokenizer.encode(TINY_PROMPTS[2])
    request = RouteRequest("r", ids)
    Dispatcher(make_router("cost", RouterConfig(block_size=BS)), tracker).dispatch(request)
    core.add_requests([CoreRequest("r", ids, _params(8), 0)])
    while core.has_unfinished_requests():
        out = core.step()
        tracker.on_frame(0, dataclasses.replace(out, kv_events=None))  # events off
        now[0] += 400_000_000
    view = tracker.views()[0]
    assert view.staleness_s > 1.0 and not view.mirror_trusted
    assert view.mirror.longest_prefix(request.block_hashes) == 0  # the mirror heard nothing...
    assert view.cached_blocks(request.block_hashes) == len(request.block_hashes)  # ...the estimate did


# ---- the step-cost fit ---------------------------------------------------------------------------

def test_step_costs_are_fitted_from_records_and_seeded_until_measured(tiny: Checkpoint) -> None:
    from tokenloop.sim.cost import StepCostModel
    from tokenloop.sim.runner import sim_core

    class Clock:
        now = 0

        def __call__(self) -> int:
            return self.now

        def advance_by(self, ns: int) -> None:
            self.now += ns

    truth = StepCostModel(step=0.004, tokens=0.0003, sampled_rows=0.001)
    config = build_engine_config("simulated", block_size=BS, num_blocks=256, max_num_batched_tokens=64)
    core = sim_core(config, truth, Clock(), vocab_size=512, max_model_len=512, kv_bytes_per_token=16,
                    observers=[EngineObserver()])
    fit = StepCostFit(DEFAULT_STEP_COSTS)
    assert fit.costs == DEFAULT_STEP_COSTS
    for i in range(24):
        core.add_requests([CoreRequest(f"r{i}", _prompt(10 + 7 * i, 3), _params(6 + i % 5), 0)])
        for _ in range(3):
            out = core.step()
            if out.record is not None:
                fit.observe(out.record)
    while core.has_unfinished_requests():
        fit.observe(core.step().record)
    fit.refit()
    # A prefill token costs `tokens`; a decode row `tokens + sampled_rows`; the bare step `step`.
    assert fit.costs.prefill_token_s == pytest.approx(0.0003, rel=1e-3)
    assert fit.costs.decode_row_s == pytest.approx(0.0013, rel=1e-3)
    assert fit.costs.step_s == pytest.approx(0.004, rel=1e-3)


# ---- each policy's choices on hand-made loads -------------------------------------------------------

def test_round_robin_cycles_over_the_candidates_only() -> None:
    router = make_router("round-robin", RouterConfig(block_size=BS))
    loads = [_load(0), _load(1, admitting=False), _load(2), _load(3, alive=False)]
    picks = [router.route(RouteRequest(f"r{i}", _prompt(8)), loads).replica for i in range(5)]
    assert picks == [0, 2, 0, 2, 0]


def test_least_load_weighs_waiting_four_times_running() -> None:
    router = make_router("least-load", RouterConfig(block_size=BS))
    loads = [_load(0, running=3, waiting=1), _load(1, running=6), _load(2, running=2, waiting=2)]
    decision = router.route(RouteRequest("r", _prompt(8)), loads)
    assert decision.scores == {0: 7.0, 1: 6.0, 2: 10.0} and decision.replica == 1


def test_least_load_counts_routed_requests_before_the_next_stats() -> None:
    tracker = LoadTracker(3, BS)
    dispatcher = Dispatcher(make_router("least-load", RouterConfig(block_size=BS)), tracker)
    picks = [dispatcher.dispatch(RouteRequest(f"r{i}", _prompt(8, 10 * i))).replica for i in range(6)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]  # optimistic increments spread a burst


def test_the_cost_router_prefers_the_replica_holding_the_prefix() -> None:
    prompt = _prompt(64)
    hashes = set(prompt_block_hashes(RouteRequest("x", prompt), BS))
    router = CostRouter(RouterConfig(block_size=BS))
    loads = [_load(0, running=2), _load(1, running=2, hashes=hashes), _load(2, running=2)]
    decision = router.route(RouteRequest("r", prompt), loads)
    assert decision.replica == 1
    assert decision.cached_tokens == 60  # 16 full blocks, but the last prompt token is always computed
    assert decision.predicted_ttft_s == pytest.approx(decision.scores[1])
    assert decision.scores[1] < decision.scores[0] == decision.scores[2]


def test_the_cost_router_leaves_the_prefix_holder_when_its_queue_outweighs_the_hit() -> None:
    prompt = _prompt(64)
    hashes = set(prompt_block_hashes(RouteRequest("x", prompt), BS))
    router = CostRouter(RouterConfig(block_size=BS))
    # 60 cached tokens save 60 ms of prefill; 200 queued prefill tokens ahead cost 200 ms.
    loads = [_load(0, running=2), _load(1, running=2, queued=200, hashes=hashes)]
    assert router.route(RouteRequest("r", prompt), loads).replica == 0
    loads[1] = _load(1, running=2, queued=30, hashes=hashes)
    assert router.route(RouteRequest("r", prompt), loads).replica == 1


def test_predicted_ttft_counts_steps_of_the_budget_beside_the_decodes() -> None:
    load = _load(0, running=12, queued=100)
    # 100 queued + 50 own = 150 tokens; budget 64 - 12 decode rows = 52 per step -> 3 steps.
    expected = 150 * 0.001 + 3 * (0.010 + 12 * 0.0005)
    assert predicted_ttft_s(load, 60, 10, RouterConfig(block_size=BS, max_num_batched_tokens=64)) == \
        pytest.approx(expected)


def test_one_hot_prefix_spreads_once_the_holders_queue_costs_more_than_recomputing() -> None:
    # llm-d #355: a skewed prefix put everything on 2 of 8 replicas. The cost term must spread it.
    tracker = LoadTracker(8, BS, seed_costs=COSTS)
    dispatcher = Dispatcher(make_router("cost", RouterConfig(block_size=BS)), tracker)
    hot = _prompt(512)
    decisions = [dispatcher.dispatch(RouteRequest(f"r{i}", hot + _prompt(64, 1000 + 64 * i)))
                 for i in range(64)]
    counts = [sum(d.replica == r for d in decisions) for r in range(8)]
    assert max(counts) <= 16, counts
    assert sum(c > 0 for c in counts) >= 4, counts
    # ...and keeps locality: each replica computes the hot prefix once, every later request there hits it.
    assert sum(d.cached_tokens == 512 for d in decisions) >= 64 - 8


# ---- affinity on ties -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["cost", "least-load"])
def test_ties_keep_first_block_affinity_stable(name: str) -> None:
    router = make_router(name, RouterConfig(block_size=BS))
    loads = [_load(i) for i in range(6)]
    prompts = [_prompt(40, 100 * k) for k in range(12)]
    first = [router.route(RouteRequest(f"a{k}", p), loads).replica for k, p in enumerate(prompts)]
    again = [router.route(RouteRequest(f"b{k}", p + [7, 8, 9]), loads).replica for k, p in enumerate(prompts)]
    assert first == again  # same first block, same replica: no rotating tie-break
    assert len(set(first)) > 1  # and different prefixes do spread
    # Rendezvous: dropping a replica nobody chose moves nothing.
    unused = next(i for i in range(6) if i not in first)
    fewer = [load for load in loads if load.index != unused]
    assert [router.route(RouteRequest(f"c{k}", p), fewer).replica for k, p in enumerate(prompts)] == first


def test_ties_keep_a_session_on_its_last_replica() -> None:
    router = make_router("cost", RouterConfig(block_size=BS))
    loads = [_load(i) for i in range(4)]
    turn1 = router.route(RouteRequest("t1", _prompt(16), session="s"), loads).replica
    # The next turn starts differently (its own first block) but stays with the session.
    replicas = {router.route(RouteRequest(f"t{i}", _prompt(16, 900 + 50 * i), session="s"), loads).replica
                for i in range(2, 8)}
    assert replicas == {turn1}
    # Unless another replica is clearly better: affinity only breaks ties.
    loads[turn1] = _load(turn1, queued=500)
    assert router.route(RouteRequest("t9", _prompt(16), session="s"), loads).replica != turn1


# ---- only alive and admitting replicas --------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(states=st.lists(st.tuples(st.booleans(), st.booleans(), st.integers(0, 8), st.integers(0, 8),
                                 st.integers(0, 600)), min_size=1, max_size=6),
       name=st.sampled_from(sorted(ROUTERS)), prompt_len=st.integers(1, 40))
def test_dead_and_draining_replicas_are_never_picked(states: list[tuple[bool, bool, int, int, int]], name: str,
                                                     prompt_len: int) -> None:
    loads = [_load(i, alive=alive, admitting=admitting, running=running, waiting=waiting, queued=queued)
             for i, (alive, admitting, running, waiting, queued) in enumerate(states)]
    router = make_router(name, RouterConfig(block_size=BS))
    if not any(load.alive and load.admitting for load in loads):
        with pytest.raises(NoReplicaError, match="no replica is alive and admitting"):
            router.route(RouteRequest("r", _prompt(prompt_len)), loads)
        return
    for i in range(3):
        decision = router.route(RouteRequest(f"r{i}", _prompt(prompt_len, 50 * i)), loads)
        assert loads[decision.replica].alive and loads[decision.replica].admitting
        assert all(loads[k].alive and loads[k].admitting for k in decision.scores)
        assert all(math.isfinite(v) for v in decision.scores.values())


def test_the_tracker_drains_kills_and_revives_replicas() -> None:
    tracker = LoadTracker(3, BS)
    dispatcher = Dispatcher(make_router("least-load", RouterConfig(block_size=BS)), tracker)
    tracker.set_admitting(0, False)
    tracker.set_alive(2, False)
    assert {dispatcher.dispatch(RouteRequest(f"r{i}", _prompt(8, 9 * i))).replica for i in range(5)} == {1}
    tracker.set_alive(2, True)  # a fresh engine: its counters start over
    assert tracker.views()[2].num_waiting == 0 and tracker.views()[2].alive
    tracker.set_admitting(1, False)
    assert dispatcher.dispatch(RouteRequest("x", _prompt(8))).replica == 2
    tracker.set_alive(2, False)
    with pytest.raises(NoReplicaError, match="0: draining, 1: draining, 2: dead"):
        dispatcher.dispatch(RouteRequest("y", _prompt(8)))


def test_an_unknown_router_lists_the_known_ones() -> None:
    with pytest.raises(InvalidRequestError, match="round-robin, least-load, cost"):
        make_router("random")


def test_the_tracker_follows_a_real_core_queue_and_finishes(tiny: Checkpoint) -> None:
    core = _core(tiny)
    tracker = LoadTracker(1, BS)
    dispatcher = Dispatcher(make_router("cost", RouterConfig(block_size=BS, max_num_batched_tokens=32)), tracker)
    uncached = 0
    for i, text in enumerate(TINY_PROMPTS):
        ids = tiny.tokenizer.encode(text)
        uncached += len(ids) - dispatcher.dispatch(RouteRequest(f"r{i}", ids)).cached_tokens
        core.add_requests([CoreRequest(f"r{i}", ids, _params(3), 0)])
    view = tracker.views()[0]
    assert view.num_waiting == len(TINY_PROMPTS)
    # "hello world" is computing when "hello world, hello again" comes: its first block counts as held.
    assert uncached < sum(len(tiny.tokenizer.encode(t)) for t in TINY_PROMPTS)
    assert view.queued_prefill_tokens == uncached
    out = core.step()
    tracker.on_frame(0, out)
    view = tracker.views()[0]
    assert (view.num_running, view.num_waiting) == (out.record.gauges.num_running, out.record.gauges.num_waiting)
    while core.has_unfinished_requests():
        tracker.on_frame(0, core.step())
    view = tracker.views()[0]
    assert view.queued_prefill_tokens == 0 and not view.inflight
    assert view.mirror.hashes == _index(core)


def test_a_full_replica_waits_for_finishes_before_it_admits() -> None:
    prompt = _prompt(64)
    hashes = set(prompt_block_hashes(RouteRequest("x", prompt), BS))
    router = CostRouter(RouterConfig(block_size=BS))
    holder = _load(1, running=8, hashes=hashes)
    holder.num_free_blocks, holder.finish_rate_per_s, holder.blocks_per_finish = 0, 5.0, 20.0
    other = _load(0, running=8)
    other.num_free_blocks = 1000
    # The holder has no free block: one finish (0.2 s away) frees enough; recomputing 60 tokens is cheaper.
    decision = router.route(RouteRequest("r", prompt), [other, holder])
    assert decision.replica == 0 and decision.scores[1] > decision.scores[0] + 0.1
    holder.num_free_blocks = 100
    assert router.route(RouteRequest("r", prompt), [other, holder]).replica == 1


def test_seed_costs_from_a_profile_count_rows_in_the_weight_form_they_run() -> None:
    from tokenloop.sim.cost import StepCostModel, WeightForms

    # One decode row runs the packed layers (2 ms a token); a 512-token chunk runs the dense copy.
    model = StepCostModel(step=0.004, tokens=0.0003, packed_tokens=0.002, dense_layers=0.02,
                          forms=WeightForms(layers_packed_max_tokens=16))
    costs = StepCosts.from_cost_model(model)
    assert costs.decode_row_s == pytest.approx(0.002)
    assert costs.prefill_token_s == pytest.approx(0.0003 + 0.02 / 512)


def test_the_command_lines_router_names_are_the_routers() -> None:
    """`tokenloop serve --router` is checked against tokenloop.config.ROUTER_NAMES before anything starts
    (without importing the router): the two lists must name the same routers."""
    from tokenloop.config import ROUTER_NAMES

    assert tuple(ROUTERS) == ROUTER_NAMES


# ---- LoRA adapters: the cost router prefers a replica with the adapter resident ----------------------

def test_cost_router_prefers_the_replica_with_the_adapter_resident() -> None:
    """Equal replicas, one prompt: each adapter's request goes where that adapter is resident (whatever the
    affinity tie-break would pick), and the other replica's score carries the slot load."""
    router = CostRouter(RouterConfig(block_size=BS, adapter_load_s=0.05))
    for holder in (0, 1):
        loads = [dataclasses.replace(_load(i), resident_adapters={"x": None} if i == holder else {"y": None})
                 for i in (0, 1)]
        decision = router.route(RouteRequest(f"r{holder}", _prompt(9), lora_name="x"), loads)
        assert decision.replica == holder
        assert decision.scores[1 - holder] == pytest.approx(decision.scores[holder] + 0.05)
    base = router.route(RouteRequest("base", _prompt(9)), loads)
    assert base.scores[0] == pytest.approx(base.scores[1])  # the base model needs no slot anywhere


def test_tracker_follows_the_adapters_a_replica_ran(tiny: Checkpoint) -> None:
    """The tracker learns a replica's resident adapters from the requests it routed there that the replica's
    steps ran, least recently run dropped first beyond its max_loras (as the replica's slots swap)."""
    core = _core(tiny)
    tracker = LoadTracker(1, BS, max_loras=2)
    ids = _prompt(6)
    for rid, adapter in (("r1", "x"), ("r2", "y"), ("r3", "x"), ("r4", "z"), ("r5", None)):
        tracker.on_routed(0, rid, len(ids), lora_name=adapter)
        core.add_requests([CoreRequest(rid, ids, _params(1), 0)])
        while core.has_unfinished_requests():
            tracker.on_frame(0, core.step())
    assert list(tracker.views()[0].resident_adapters) == ["x", "z"]
