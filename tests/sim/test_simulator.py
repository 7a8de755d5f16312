"""The simulated engine: the real scheduler and KV cache run a trace on a virtual clock priced by a cost
model; outputs have the trace's lengths; time moves by exactly the modelled step costs."""

from __future__ import annotations

from tokenloop.bench.replay import (
    SIMULATED_CLOCK,
    VirtualClock,
    greedy_params,
    replay_engine,
)
from tokenloop.bench.trace import TraceRequest
from tokenloop.llm import build_engine_config
from tokenloop.observe.records import EngineObserver, StepRecord
from tokenloop.request import NS_PER_S, SamplingParams
from tokenloop.sim.cost import (
    StepCostModel,
    StepFeatures,
    WeightForms,
    features_of_record,
)
from tokenloop.sim.engine import SimulatedEngine

COST = StepCostModel(step=0.010, tokens=0.0002, kv_read_tokens=1e-6, prefill_attn=1e-8, sampled_rows=1e-4,
                     seqs=5e-5)
VOCAB = 64


class Keep(EngineObserver):
    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def on_step(self, record: StepRecord) -> None:
        self.records.append(record)


def make(clock: VirtualClock, **options: object) -> SimulatedEngine:
    config = build_engine_config("simulated", **({"block_size": 4, "num_blocks": 64} | options))
    return SimulatedEngine(config, COST, clock, vocab_size=VOCAB, max_model_len=256, kv_bytes_per_token=1024)


def request(i: int, arrival_s: float, prompt: tuple[int, ...], max_tokens: int) -> TraceRequest:
    return TraceRequest(id=f"r{i}", arrival_s=arrival_s, max_tokens=max_tokens, prompt_tokens=prompt)


def test_a_trace_runs_to_completion_with_preemption_and_prefix_hits() -> None:
    shared = tuple(range(1, 17))  # four full blocks every request starts with
    trace = [request(i, i * 0.001, shared + tuple(range(20 + i, 24 + i)), 10 + 3 * i) for i in range(12)]
    keep = Keep()

    def make_engine(clock: VirtualClock) -> SimulatedEngine:
        engine = make(clock, num_blocks=24, max_num_seqs=8)  # 96 token slots: too few for 8 at once
        engine.add_observer(keep)
        return engine

    run = replay_engine(trace, make_engine, label="fcfs", clock_mode=SIMULATED_CLOCK, progress=False)
    assert all(r.finish_reason == "length" for r in run.records)
    assert [r.output_len for r in run.records] == [r.max_tokens for r in trace]
    assert run.num_preemptions and run.num_preemptions > 0
    assert run.prefix_cache_hits and run.prefix_cache_hits > 0
    # Every sampled token but each request's last is the filler; the last is EOS.
    last: dict[str, int] = {}
    for record in keep.records:
        for rid, token in zip(record.sampled_ids, record.sampled_tokens):
            assert token in (VOCAB - 2, VOCAB - 1)
            last[rid] = token
    assert set(last.values()) == {VOCAB - 1}
    assert keep.records[-1].gauges.num_free_blocks == 24  # nothing referenced at the end


def test_time_moves_by_the_modelled_step_costs() -> None:
    clock = VirtualClock()
    keep = Keep()
    engine = make(clock)
    engine.add_observer(keep)
    engine.add_request("lone", None, greedy_params(5), prompt_token_ids=list(range(1, 11)), arrival_ns=0)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (out,) = outputs
    costs = [COST.step_seconds(features_of_record(r)) for r in keep.records]
    prefill = COST.step_seconds(StepFeatures(tokens=10, kv_read_tokens=10, prefill_attn=100, sampled_rows=1,
                                             seqs=1))
    assert abs(costs[0] - prefill) < 1e-12
    assert abs(out.metrics.first_token_time - prefill) < 1e-9  # TTFT of a lone request = its prefill step
    assert len(out.metrics.itls_s) == 4
    for itl, cost in zip(out.metrics.itls_s, costs[1:]):
        assert abs(itl - cost) < 1e-9
    assert clock() == engine.runner.modelled_ns == sum(round(c * NS_PER_S) for c in costs)
    for record in keep.records:  # the forward is where modelled time passes; every other stage takes none
        assert record.end_ns - record.start_ns == record.forward_ns


def test_eos_stops_a_request_at_its_recorded_length_without_ignore_eos() -> None:
    engine = make(VirtualClock())
    engine.add_request("a", None, SamplingParams(temperature=0.0, max_tokens=7), prompt_token_ids=[1, 2, 3])
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (out,) = outputs
    assert out.outputs[0].finish_reason == "stop"  # by EOS, the real update stage's check
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].token_ids[-1] == VOCAB - 1


def test_the_runner_dictates_the_tokens_whatever_the_sampling_params() -> None:
    # The runner hands the core its tokens (no logits): a request that would draw at temperature 1 still
    # gets the trace's filler tokens and its EOS at the recorded length, and no sampler runs.
    engine = make(VirtualClock())
    engine.core.sampler.sample = None  # type: ignore[assignment,method-assign]  # a call would raise
    engine.add_request("a", None, SamplingParams(temperature=1.0, max_tokens=6), prompt_token_ids=[1, 2, 3])
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (out,) = outputs
    assert out.outputs[0].token_ids == [VOCAB - 2] * 5 + [VOCAB - 1]
    assert out.outputs[0].finish_reason == "stop"


def test_roofline_cost_is_the_slower_side() -> None:
    roof = StepCostModel(step=0.005, tokens=1e-5, combine="max")
    assert roof.step_seconds(StepFeatures(tokens=1)) == 0.005
    assert roof.critical_path(StepFeatures(tokens=1)) == "bandwidth"
    assert abs(roof.step_seconds(StepFeatures(tokens=1000)) - 0.01) < 1e-12
    assert roof.critical_path(StepFeatures(tokens=1000)) == "compute"


def test_the_runner_prices_each_step_in_the_weight_form_its_rows_run() -> None:
    # Packed up to 4 tokens (2 ms a token), a dense copy above (50 ms more, nothing a token).
    forms = WeightForms(layers_packed_max_tokens=4)
    cost = StepCostModel(step=0.001, packed_tokens=0.002, dense_layers=0.05, forms=forms)
    clock = VirtualClock()
    keep = Keep()
    engine = SimulatedEngine(build_engine_config("simulated", block_size=4, num_blocks=64), cost, clock,
                             vocab_size=VOCAB, max_model_len=256, kv_bytes_per_token=1024, observers=[keep])
    engine.add_request("a", None, greedy_params(3), prompt_token_ids=list(range(1, 11)), arrival_ns=0)
    while engine.has_unfinished_requests():
        engine.step()
    # A 10-token prefill on the dense copy, then two 1-token decodes on the packed form.
    assert [r.num_batched_tokens for r in keep.records] == [10, 1, 1]
    assert clock() == round(0.051 * NS_PER_S) + 2 * round(0.003 * NS_PER_S)


def test_the_admission_order_from_the_step_records_is_the_running_queue_scans(monkeypatch) -> None:
    # Bursts admit several requests a step; one-token requests finish in the step that admits them (they
    # follow the ones still running); a small pool preempts and resumes (already noted: not again).
    trace = [request(i, (i // 5) * 0.004, tuple(range(1 + i % 7, 9 + i % 7 + 3 * (i % 4))), (1, 2, 6, 15)[i % 4])
             for i in range(60)]

    def admission_order() -> list[str]:
        run = replay_engine(trace, lambda clock: make(clock, num_blocks=20, max_num_seqs=6),
                            label="fcfs", clock_mode=SIMULATED_CLOCK, progress=False)
        assert run.num_preemptions and all(r.finish_reason == "length" for r in run.records)
        return run.admission_order

    from_records = admission_order()
    # Without the record (as when an engine's records do not reach the replay), the running queue is scanned.
    monkeypatch.setattr("tokenloop.bench.replay._LastStep.on_step", lambda self, record: setattr(
        self, "num_scheduled", record.num_scheduled))
    assert from_records == admission_order()
    assert sorted(from_records) == sorted(r.id for r in trace)


def test_the_cyclic_collector_is_off_during_a_run_and_as_it_was_after() -> None:
    import gc

    import pytest

    from tokenloop.sim.engine import cyclic_gc_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError), cyclic_gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("a run that fails")
    assert gc.isenabled()
    gc.disable()
    try:
        with cyclic_gc_paused():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()
