"""Simulated replicas on one timeline: each replica runs as it would alone, the router sees time in order."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tokenloop.bench.replay import SIMULATED_CLOCK, replay_engine
from tokenloop.bench.trace import TraceRequest, write_trace
from tokenloop.cli.main import main
from tokenloop.core.messages import CoreOutputs
from tokenloop.llm import build_engine_config
from tokenloop.request import NS_PER_S
from tokenloop.sim.cluster import SimRequest, SimulatedCluster
from tokenloop.sim.cost import StepCostModel
from tokenloop.sim.engine import SimulatedEngine

COST = StepCostModel(step=0.010, tokens=0.0002, kv_read_tokens=1e-6, sampled_rows=1e-4)
VOCAB = 512


def _config(**options: object):
    return build_engine_config("simulated", **({"block_size": 4, "num_blocks": 64, "enable_kv_events": True}
                                               | options))


def _cluster(n: int) -> SimulatedCluster:
    return SimulatedCluster(n, _config(), COST, vocab_size=VOCAB, max_model_len=256, kv_bytes_per_token=64)


def _trace(n: int = 16) -> list[TraceRequest]:
    shared = tuple(range(1, 13))
    return [TraceRequest(id=f"r{i}", arrival_s=round(0.004 * i + (0.02 if i % 5 == 0 else 0), 6),
                         max_tokens=3 + i % 6,
                         prompt_tokens=shared[:4 * (i % 3)] + tuple(range(40 + 9 * i, 49 + 9 * i)),
                         user=f"s{i % 3}")
            for i in range(n)]


def _requests(trace: list[TraceRequest]) -> list[SimRequest]:
    return [SimRequest(r.id, int(round(r.arrival_s * NS_PER_S)), r.prompt_tokens, r.max_tokens, session=r.user)
            for r in trace]


def test_each_replica_runs_exactly_as_it_would_alone() -> None:
    trace = _trace()
    assign = {r.id: (i * 7) % 3 for i, r in enumerate(trace)}  # a fixed, uneven routing
    cluster = _cluster(3)
    run = cluster.run(_requests(trace), lambda request, now: assign[request.request_id], lambda i, out: None)
    assert not run.errors and set(run.outputs) == {r.id for r in trace}
    for replica in range(3):
        alone = replay_engine(
            [r for r in trace if assign[r.id] == replica],
            lambda clock: SimulatedEngine(_config(), COST, clock, vocab_size=VOCAB, max_model_len=256,
                                          kv_bytes_per_token=64),
            label="alone", clock_mode=SIMULATED_CLOCK, progress=False)
        for record in alone.records:
            index, output = run.outputs[record.id]
            assert index == replica
            metrics = output.metrics
            assert metrics.first_token_time == pytest.approx(record.first_token_s, abs=1e-9)
            assert metrics.last_token_time == pytest.approx(record.last_token_s, abs=1e-9)
            assert len(output.outputs[0].token_ids) == record.max_tokens
        assert run.replicas[replica].num_requests == len(alone.records)
        assert run.replicas[replica].prefix_cache_hits == alone.prefix_cache_hits


def test_the_router_sees_frames_in_time_order_and_up_to_each_arrival() -> None:
    trace = _trace(24)
    cluster = _cluster(2)
    seen: list[tuple[int, int]] = []  # (delivery instant, step end)
    routed_at: list[tuple[int, int]] = []  # (arrival, frames delivered so far)

    def on_frame(index: int, outputs: CoreOutputs) -> None:
        assert outputs.record is not None  # every delivered step carries its record (the tracker's gauges)
        seen.append((cluster.now_ns(), outputs.record.end_ns))

    def route(request: SimRequest, now: int) -> int:
        assert now == request.arrival_ns == cluster.now_ns()
        routed_at.append((now, len(seen)))
        return int(request.request_id[1:]) % 2

    cluster.run(_requests(trace), route, on_frame)
    assert [t for t, _ in seen] == sorted(t for t, _ in seen)
    assert all(delivered == end for delivered, end in seen)  # a frame arrives when its step ends
    for now, count in routed_at:
        # Every step that ended by the arrival was delivered before it was routed; none that ended later.
        assert all(end <= now for _, end in seen[:count])
        assert all(end > now for _, end in seen[count:])


def test_replicas_need_kv_events() -> None:
    with pytest.raises(ValueError, match="KV events"):
        SimulatedCluster(2, _config(enable_kv_events=False), COST, vocab_size=VOCAB, max_model_len=256,
                         kv_bytes_per_token=64)


def test_simulate_compares_routers_on_replicas(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(_trace(30), path)
    out = tmp_path / "r.json"
    rc = main(["simulate", "--trace", str(path), "--profile", "h100-llama3-8b", "--replicas", "3",
               "--router", "round-robin,least-load,cost", "--save-result", str(out),
               "--report", str(tmp_path / "r.html"), "--disable-tqdm"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Router comparison" in text and "Routers on 3 replicas" in text and "P90 TTFT (ms)" in text
    document = json.loads(out.read_text())
    assert [run["label"] for run in document["runs"]] == ["round-robin", "least-load", "cost"]
    for run in document["runs"]:
        per = run["settings"]["per_replica"]
        assert len(per) == 3 and sum(p["requests"] for p in per) == 30
        assert all(r["finish_reason"] == "length" for r in run["requests"])
    rr = document["runs"][0]["settings"]["per_replica"]
    assert [p["requests"] for p in rr] == [10, 10, 10]
    page = (tmp_path / "r.html").read_text()
    assert page.startswith("<!")
    # The report shows what a cluster adds and the energy per request, each with its plots.
    sections = dict(re.findall(r'<section id="([\w-]+)">(.*?)</section>', page, flags=re.DOTALL))
    assert "Requests per replica" in sections["cluster"] and sections["cluster"].count("<svg") == 3
    assert "Energy per request" in sections["energy"] and "<svg" in sections["energy"]
    mean_j = document["runs"][0]["settings"]["energy_per_request"]["mean_j"]
    assert f"{mean_j:.2f}" in sections["energy"]


def test_an_unknown_router_is_an_error_naming_the_known_ones(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(_trace(4), path)
    assert main(["simulate", "--trace", str(path), "--replicas", "2", "--router", "random"]) == 2
    assert "unknown router 'random' (valid: round-robin, least-load, cost)" in capsys.readouterr().err
