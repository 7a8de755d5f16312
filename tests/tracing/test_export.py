"""Exports: the mechanism scenario has the seed's schema and measured durations; the Chrome trace is well formed."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.tracing.conftest import PROMPTS, make_engine, run_to_end
from tokenloop.engine import LLMEngine
from tokenloop.model.loader import Checkpoint
from tokenloop.observe.exports import request_timeline
from tokenloop.observe.records import Stage
from tokenloop.observe.tracer import Tracer
from tokenloop.request import RequestStatus, SamplingParams

SEED = json.loads((Path(__file__).parent / "data" / "serving_loop_seed.json").read_text())


@pytest.fixture(scope="module")
def traced_run(tiny: Checkpoint) -> tuple[Tracer, LLMEngine, dict[str, Any]]:
    """Five requests on a small pool (preemptions), a repeated prompt (prefix hits), one abort."""
    tracer = Tracer()
    engine = make_engine(tiny, tracer, num_blocks=24, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    engine.add_request("doomed", PROMPTS[1], params)
    outputs: dict[str, Any] = {}
    for _ in range(4):
        outputs |= {o.request_id: o for o in engine.step()}
    outputs |= {o.request_id: o for o in engine.abort_request("doomed")}
    outputs |= run_to_end(engine)
    # The longest request finished last, so its prompt blocks are the last to be evicted: prefix hits.
    engine.add_request("again", PROMPTS[2], params)
    outputs |= run_to_end(engine)
    assert engine.stats().num_preemptions > 0
    return tracer, engine, outputs


def check_mechanism_schema(doc: dict[str, Any]) -> None:
    """Same top-level, scenario, step and state keys as the seed; steps name only declared targets."""
    assert list(doc) == list(SEED)
    assert doc["version"] == SEED["version"] and doc["language"] == SEED["language"]
    assert doc["targets"] == SEED["targets"]  # the seed's node and edge ids and kinds
    assert doc["stateLabels"] == SEED["stateLabels"]
    assert all(set(source) == set(SEED["sources"][0]) for source in doc["sources"])
    assert isinstance(doc["limitations"], list) and doc["limitations"]
    seed_scenario, seed_step = SEED["scenarios"][0], SEED["scenarios"][0]["steps"][0]
    for scenario in doc["scenarios"]:
        assert list(scenario) == list(seed_scenario)
        assert set(scenario["initial"]) == set(seed_scenario["initial"])
        for step in scenario["steps"]:
            assert list(step) == list(seed_step)
            assert set(step["state"]) == set(seed_step["state"])
            assert isinstance(step["duration"], (int, float)) and step["duration"] >= 0
            for key in step["active"] + step["paths"]:
                assert key in doc["targets"], key
            assert all(doc["targets"][k]["kind"] == "node" for k in step["active"])
            assert all(doc["targets"][k]["kind"] == "edge" for k in step["paths"])
            assert step["title"] and step["description"] and step["state"]["artifact"]


@pytest.mark.parametrize("request_id", ["r0", "r2", "again", "doomed"])
def test_mechanism_durations_add_up_to_the_measured_times(traced_run, request_id: str) -> None:
    tracer, _, outputs = traced_run
    doc = tracer.mechanism(request_id)
    check_mechanism_schema(doc)
    trace = tracer.get(request_id)
    assert trace is not None and trace.lifetime_ns is not None
    steps = doc["scenarios"][0]["steps"]
    durations = [step["duration"] for step in steps]
    # All the steps: arrival to the end of the release of its references.
    assert abs(sum(durations) - trace.lifetime_ns / 1e6) < 1.0
    assert steps[0]["title"] == "Wait in the queue"
    assert steps[-1]["active"] == ["release"] and steps[-1]["paths"] == ["finished"]
    metrics = outputs[request_id].metrics
    if request_id == "doomed":
        assert "abort" in doc["scenarios"][0]["description"]
        return
    # Up to the step that sampled the last token: the engine's own e2e latency (RequestTimes).
    last_sample = max(i for i, s in enumerate(steps) if s["paths"] == ["sample-output"])
    assert abs(sum(durations[:last_sample + 1]) - metrics.e2e_s * 1e3) < 1.0
    first_sample = min(i for i, s in enumerate(steps) if s["paths"] == ["sample-output"])
    assert abs(sum(durations[:first_sample + 1]) - metrics.ttft_s * 1e3) < 1.0
    assert abs(steps[0]["duration"] - metrics.queue_wait_s * 1e3) < 1.0
    # Artifacts carry the real values: every sampled token id, in order, and the prefix-hit tokens.
    sampled = [s["state"]["artifact"] for s in steps if s["paths"] == ["sample-output"]]
    assert len(sampled) == len(outputs[request_id].outputs[0].token_ids)
    for artifact, token in zip(sampled, outputs[request_id].outputs[0].token_ids):
        assert artifact.startswith(f"token id {token} ")
    kv_steps = [s["state"]["artifact"] for s in steps if s["paths"] == ["allocate"]]
    assert kv_steps and kv_steps[0].startswith("allocated ")
    hits = next(e for e in trace.events if e.name == "admitted").args["prefix_hit_tokens"]
    assert request_id != "again" or hits > 0
    assert (f"({hits} prefix hit tokens)" in kv_steps[0]) == (hits > 0)
    assert "batch of" in next(s for s in steps if s["paths"] == ["admit"])["state"]["artifact"]


def test_mechanism_of_a_preempted_request_has_the_preemption(traced_run) -> None:
    tracer, _, _ = traced_run
    preempted = [rid for rid in tracer.request_ids()
                 if any(e.name == "preempted" for e in tracer.get(rid).events)]  # type: ignore[union-attr]
    assert preempted
    steps = tracer.mechanism(preempted[0])["scenarios"][0]["steps"]
    assert any(s["title"].startswith("Preempted") for s in steps)
    assert any("recompute" in s["state"]["artifact"] for s in steps)


def test_timeline_tiles_the_lifetime(traced_run) -> None:
    tracer, _, _ = traced_run
    for rid in tracer.request_ids():
        trace = tracer.get(rid)
        assert trace is not None
        segments = request_timeline(trace)
        assert segments[0].start_ns == trace.arrival_ns
        assert trace.release is not None and segments[-1].end_ns == trace.release.end_ns
        for a, b in zip(segments, segments[1:]):
            assert a.end_ns == b.start_ns
        assert all(s.duration_ns >= 0 for s in segments), [(s.kind, s.duration_ns) for s in segments]
        # One spelling: a stage of the loop, or where the request was between its steps.
        assert segments[0].kind is RequestStatus.WAITING and segments[-1].kind is Stage.RELEASE
        assert {s.kind for s in segments} <= set(Stage) | {RequestStatus.RUNNING, RequestStatus.PREEMPTED,
                                                           RequestStatus.WAITING}


def check_chrome_trace(doc: dict[str, Any]) -> dict[int, str]:
    """Valid JSON, well-formed X events nested per track, metadata naming every track. Returns tid -> name."""
    doc = json.loads(json.dumps(doc))  # round trip: plain JSON types only
    events = doc["traceEvents"]
    names: dict[int, str] = {}
    spans: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        assert event["ph"] in ("X", "M", "i"), event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "M":
            if event["name"] == "thread_name":
                assert event["tid"] not in names
                names[event["tid"]] = event["args"]["name"]
        elif event["ph"] == "X":
            assert isinstance(event["ts"], int) and isinstance(event["dur"], int) and event["dur"] >= 0
            assert event["name"]
            spans[event["tid"]].append(event)
        else:
            assert isinstance(event["ts"], int) and event["s"] == "t"
    assert set(spans) <= set(names)
    for tid, track in spans.items():  # complete events on one track must nest, never overlap
        track.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict[str, Any]] = []
        for event in track:
            while stack and event["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack:
                parent = stack[-1]
                assert event["ts"] + event["dur"] <= parent["ts"] + parent["dur"], (names[tid], parent, event)
            stack.append(event)
    return names


def test_chrome_trace_of_everything(traced_run) -> None:
    tracer, engine, _ = traced_run
    doc = tracer.chrome_trace()
    names = check_chrome_trace(doc)
    request_tracks = sorted(name for name in names.values() if name.startswith("request "))
    assert request_tracks == sorted(f"request {rid}" for rid in tracer.request_ids())  # one track per request
    assert "engine loop" in names.values()
    loop_tid = next(tid for tid, name in names.items() if name == "engine loop")
    loop = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == loop_tid]
    assert sum(e["name"].startswith("step ") for e in loop) == engine.num_steps
    assert {"schedule", "kv", "execute", "sample", "update", "release"} <= {e["name"] for e in loop}
    phases = {e["name"] for e in doc["traceEvents"] if e["ph"] == "X" and e.get("cat") == "phase"}
    assert {"queued", "prefill", "decode", "preempted", "recompute", "release"} <= phases


def test_chrome_trace_of_one_request(traced_run) -> None:
    tracer, _, _ = traced_run
    doc = tracer.chrome_trace("r0")
    names = check_chrome_trace(doc)
    assert sorted(names.values()) == ["engine loop", "request r0"]
    instants = [e["name"] for e in doc["traceEvents"] if e["ph"] == "i"]
    assert instants[0] == "arrival" and instants[-1] == "released" and "first_token" in instants
    with pytest.raises(KeyError):
        tracer.chrome_trace("nobody")
