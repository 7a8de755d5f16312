"""The tracer on the tiny model: off records nothing; events cover arrival..release, preemption and abort."""

from __future__ import annotations

from tests.tracing.conftest import GREEDY, PROMPTS, make_engine, run_to_end
from tokenloop.core.kv_cache import KVCacheManager
from tokenloop.model.loader import Checkpoint
from tokenloop.observe.records import STAGES
from tokenloop.observe.tracer import Tracer
from tokenloop.request import SamplingParams


def _names(tracer: Tracer, request_id: str) -> list[str]:
    trace = tracer.get(request_id)
    assert trace is not None
    return [event.name for event in trace.sorted_events()]


def test_no_tracer_by_default_and_a_disabled_tracer_records_nothing(tiny: Checkpoint) -> None:
    plain = make_engine(tiny)
    assert plain.tracer is None
    assert type(plain.kv_cache) is KVCacheManager

    tracer = Tracer(enabled=False)
    engine = make_engine(tiny, tracer)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.abort_request("r3")
    run_to_end(engine)
    assert engine.num_steps > 0
    assert not tracer.iterations and not tracer.summaries and not tracer.ttfts and not tracer.throughput
    assert tracer.request_ids() == []
    assert set(tracer.totals.values()) == {0}
    assert type(engine.kv_cache) is KVCacheManager  # the tracer watches records: it wraps nothing


def test_tracing_does_not_change_outputs(tiny: Checkpoint) -> None:
    outputs = []
    for tracer in (None, Tracer()):
        engine = make_engine(tiny, tracer, num_blocks=24)  # small: preemptions happen
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, GREEDY)
        outputs.append({rid: o.outputs[0].token_ids for rid, o in run_to_end(engine).items()})
    assert outputs[0] == outputs[1]


def test_iterations_tile_the_step_with_the_loop_stages(tiny: Checkpoint) -> None:
    tracer = Tracer()
    engine = make_engine(tiny, tracer)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    run_to_end(engine)
    iterations = list(tracer.iterations)
    assert len(iterations) == engine.num_steps
    assert [it.index for it in iterations] == list(range(1, engine.num_steps + 1))
    for it in iterations:
        stages = it.stage_ns()
        assert list(stages) == list(STAGES)
        assert all(v >= 0 for v in stages.values()), stages
        assert sum(stages.values()) == it.end_ns - it.start_ns
    for earlier, later in zip(iterations, iterations[1:]):
        assert earlier.end_ns <= later.start_ns
    assert sum(it.num_sampled for it in iterations) == tracer.totals["output_tokens"] == len(PROMPTS) * 12
    assert sum(it.num_admitted for it in iterations) == len(PROMPTS)
    assert sum(it.num_finished for it in iterations) == len(PROMPTS)
    assert any(it.release_ns > 0 for it in iterations)
    assert tracer.totals["finished"] == len(PROMPTS)


def test_events_cover_arrival_to_release_with_preemption_and_abort(tiny: Checkpoint) -> None:
    tracer = Tracer()
    # 24 blocks of 4 tokens for five requests of ~10-25 prompt + 30 output tokens: preemption is forced.
    engine = make_engine(tiny, tracer, num_blocks=24, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    engine.add_request("queued-abort", "never scheduled", params)
    engine.abort_request("queued-abort")  # aborted while still waiting
    steps = 0
    running_abort_done = False
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        request = engine.scheduler.get_request("r1")
        if not running_abort_done and request is not None and request.num_output_tokens >= 3:
            engine.abort_request("r1")  # aborted while running, holding blocks
            running_abort_done = True
    assert running_abort_done
    engine.kv_cache.check_invariants([])
    assert engine.stats().num_preemptions > 0

    assert _names(tracer, "queued-abort") == ["arrival", "queued", "aborted", "released"]
    queued = tracer.get("queued-abort")
    assert queued is not None and queued.release is not None and queued.release.block_ids == []
    assert queued.finish_reason == "abort"

    aborted = tracer.get("r1")
    assert aborted is not None and aborted.release is not None
    names = _names(tracer, "r1")
    assert names[:3] == ["arrival", "queued", "admitted"] and names[-2:] == ["aborted", "released"]
    assert "first_token" in names
    assert [e.args["reason"] for e in aborted.events if e.name == "aborted"] == ["abort"]
    assert len(aborted.release.block_ids) > 0

    preempted = [rid for rid in tracer.request_ids()
                 if "preempted" in _names(tracer, rid)]
    assert preempted, "the tiny pool should have forced a preemption"
    for rid in preempted:
        names = _names(tracer, rid)
        assert names.index("preempted") < names.index("resumed")
        assert names.count("preempted") == names.count("resumed") or names[-2] == "aborted"
        trace = tracer.get(rid)
        assert trace is not None and any(c.kind == "recompute" for c in trace.chunks)

    for rid in tracer.request_ids():
        trace = tracer.get(rid)
        assert trace is not None and trace.release is not None
        events = trace.sorted_events()
        assert events[0].name == "arrival" and events[-1].name == "released"
        release = trace.release
        assert release.num_freed + release.num_kept_cached + release.num_still_shared == len(release.block_ids)
        released = events[-1].args
        assert released["freed"] + released["kept_cached"] + released["still_shared"] == released["blocks"]
        if rid != "queued-abort":
            assert [e.name for e in events].count("admitted") == 1
            admitted = next(e for e in events if e.name == "admitted").args
            assert {"prefix_hit_tokens", "blocks_allocated", "blocks_reused"} <= set(admitted)
            assert any(e.name == "prefill_chunk" for e in events)
        if rid not in ("queued-abort", "r1"):
            assert trace.finish_reason == "length"
            assert [e.args["reason"] for e in events if e.name == "finished"] == ["length"]
            assert trace.chunks[-1].token_id == trace.output_token_ids[-1]
            assert [c.token_id for c in trace.chunks if c.token_id is not None] == trace.output_token_ids


def test_prefix_hit_is_recorded_as_reused_blocks(tiny: Checkpoint) -> None:
    tracer = Tracer()
    engine = make_engine(tiny, tracer)
    prompt = PROMPTS[2]  # long enough for several full blocks of 4
    engine.add_request("first", prompt, GREEDY)
    run_to_end(engine)
    engine.add_request("second", prompt, GREEDY)
    run_to_end(engine)
    first, second = tracer.get("first"), tracer.get("second")
    assert first is not None and second is not None
    admitted = next(e for e in second.events if e.name == "admitted").args
    assert admitted["prefix_hit_tokens"] > 0 and admitted["blocks_reused"] == admitted["prefix_hit_tokens"] // 4
    assert first.release is not None and first.release.num_kept_cached > 0  # completion did not free them
    assert set(second.chunks[0].reused_block_ids) <= set(first.release.block_ids)
    assert any(it.blocks_reused > 0 for it in tracer.iterations)


def test_sampling_and_bounded_buffers(tiny: Checkpoint) -> None:
    tracer = Tracer(sample_rate=0.0, max_iterations=5, max_summaries=3)
    engine = make_engine(tiny, tracer)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    run_to_end(engine)
    assert tracer.request_ids() == []  # no request sampled for detail
    assert len(tracer.iterations) == 5 and tracer.iterations[-1].index == engine.num_steps
    assert len(tracer.summaries) == 3 and tracer.totals["finished"] == len(PROMPTS)
    assert len(tracer.ttfts) == 3

    kept = Tracer(max_requests=2)
    engine = make_engine(tiny, kept)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    run_to_end(engine)
    assert len(kept.request_ids()) == 2


def test_dashboard_state_snapshot(tiny: Checkpoint) -> None:
    tracer = Tracer()
    engine = make_engine(tiny, tracer)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.step()
    state = tracer.dashboard_state()
    assert state["counters"]["running"] + state["counters"]["waiting"] == len(PROMPTS)
    kv = state["kv"]
    assert kv["referenced"] + kv["cached_free"] + kv["free"] == kv["num_blocks"] == 128
    assert kv["referenced"] > 0
    assert [r["id"] for r in state["requests"]] == [f"r{i}" for i in range(len(PROMPTS))]
    run_to_end(engine)
    state = tracer.dashboard_state()
    assert state["counters"]["running"] == 0 and state["counters"]["finished"] == len(PROMPTS)
    assert state["kv"]["referenced"] == 0 and state["kv"]["cached_free"] > 0
    for request in state["requests"]:
        assert request["arrival_ms"] <= request["admitted_ms"] <= request["first_token_ms"] <= request["end_ms"]
    assert len(state["iterations"]) == engine.num_steps
    assert state["stages"] == list(STAGES)  # the page draws the server's list, in the loop's order
    assert list(state["iterations"][0]["stages_ms"]) == list(STAGES)
    assert len(state["ttft"]) == len(PROMPTS)


def test_switching_off_mid_run_ends_live_traces_and_switching_on_resumes(tiny: Checkpoint) -> None:
    tracer = Tracer()
    engine = make_engine(tiny, tracer)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.step()
    tracer.enabled = False
    num_iterations = len(tracer.iterations)
    run_to_end(engine)
    assert len(tracer.iterations) == num_iterations  # nothing recorded while off
    assert sorted(tracer.request_ids()) == [f"r{i}" for i in range(len(PROMPTS))]
    assert all(not tracer.get(f"r{i}").finished for i in range(len(PROMPTS)))  # type: ignore[union-attr]
    tracer.enabled = True
    engine.add_request("later", PROMPTS[0], GREEDY)
    run_to_end(engine)
    later = tracer.get("later")
    assert later is not None and later.finished and later.finish_reason == "length"
