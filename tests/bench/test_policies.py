"""Policy replays on the tiny model: each policy orders a crafted trace as it should (observed, not
assumed), the clocks behave, the HF baseline batches statically, and the report is self-contained."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.bench.conftest import crafted
from tokenloop.bench.cli import add_bench_subparser, main, run_policies_command
from tokenloop.bench.policies import PolicyBenchConfig, parse_base_urls, parse_step_cost, run_policy_benchmark
from tokenloop.bench.replay import ReplayRecord, ReplayRun, StepCost, VirtualClock, replay_engine
from tokenloop.bench.replay_hf import replay_hf_static
from tokenloop.bench.report import render_html, summarize_run
from tokenloop.bench.trace import TraceRequest, dumps_trace
from tokenloop.engine import LLMEngine
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint

# One request runs at a time, so the order of admission is the policy's order and nothing else.
SERIAL = dict(max_num_seqs=1, block_size=4, num_blocks=256, max_num_batched_tokens=64)


def replay(checkpoint: Checkpoint, policy: str, trace: list[TraceRequest], clock: str = "cost",
           **options: Any) -> ReplayRun:
    config = build_engine_config(str(checkpoint.path), policy=policy, **(SERIAL | options))
    return replay_engine(trace, lambda c: LLMEngine(config, checkpoint=checkpoint, clock=c), label=policy,
                         clock_mode=clock, step_cost=StepCost(10.0), progress=False)


def field_order(run: ReplayRun, name: str) -> list[Any]:
    return [getattr(run.record(rid), name) for rid in run.admission_order]


def test_fcfs_follows_arrival_and_priority_serves_the_urgent_class_first(tiny_checkpoint: Checkpoint) -> None:
    # A blocker runs first; the rest, classes interleaved, all arrive while it runs.
    trace = [crafted(0, 0.0, priority=1)] + [crafted(i, i / 1000, priority=i % 2) for i in range(1, 9)]
    fcfs = replay(tiny_checkpoint, "fcfs", trace)
    priority = replay(tiny_checkpoint, "priority", trace)
    assert fcfs.admission_order == [r.id for r in trace]
    assert field_order(priority, "priority") == [1, 0, 0, 0, 0, 1, 1, 1, 1]
    assert field_order(priority, "id")[1:5] == ["r2", "r4", "r6", "r8"]  # arrival order within the class

    def mean_ttft(run: ReplayRun, cls: int) -> float:
        group = summarize_run(run).by_priority[cls]
        return group.latencies["ttft"].mean or 0.0

    assert mean_ttft(priority, 0) < mean_ttft(priority, 1)
    assert mean_ttft(priority, 0) < mean_ttft(fcfs, 0)
    # TTFTs order like the admissions: each admitted request got its first token after the previous one.
    ttfts = [priority.record(rid).first_token_s for rid in priority.admission_order]
    assert ttfts == sorted(ttfts)


def test_sjf_serves_short_jobs_first(tiny_checkpoint: Checkpoint) -> None:
    trace = [crafted(0, 0.0)] + [crafted(i, i / 1000, max_tokens=2 if i % 2 else 30) for i in range(1, 9)]
    fcfs = replay(tiny_checkpoint, "fcfs", trace)
    sjf = replay(tiny_checkpoint, "sjf", trace)
    assert field_order(fcfs, "max_tokens") == [4, 2, 30, 2, 30, 2, 30, 2, 30]
    assert field_order(sjf, "max_tokens") == [4, 2, 2, 2, 2, 30, 30, 30, 30]
    short_e2el = [sjf.record(f"r{i}").e2el_s for i in (1, 3, 5, 7)]
    assert max(short_e2el) < min(fcfs.record(f"r{i}").e2el_s for i in (5, 7))


def test_fair_alternates_users(tiny_checkpoint: Checkpoint) -> None:
    # User a floods first; user b's three requests arrive behind all of a's.
    trace = [crafted(0, 0.0)] + [crafted(i, i / 1000) for i in range(1, 7)] + \
        [crafted(i, i / 1000, user="b") for i in range(7, 10)]
    fcfs = replay(tiny_checkpoint, "fcfs", trace)
    fair = replay(tiny_checkpoint, "fair", trace)
    assert field_order(fcfs, "user") == ["a"] * 7 + ["b"] * 3
    assert field_order(fair, "user")[:7] == ["a", "b", "a", "b", "a", "b", "a"]
    b_ttft = [fair.record(f"r{i}").ttft_s for i in (7, 8, 9)]
    assert max(b_ttft) < min(fcfs.record(f"r{i}").ttft_s for i in (7, 8, 9))


def test_cost_clock_is_deterministic_and_stamps_steps(tiny_checkpoint: Checkpoint) -> None:
    trace = [crafted(0, 0.0, max_tokens=3), crafted(1, 0.001, max_tokens=2)]
    first = replay(tiny_checkpoint, "fcfs", trace)
    again = replay(tiny_checkpoint, "fcfs", trace)
    assert [r.__dict__ for r in first.records] == [r.__dict__ for r in again.records]
    r0, r1 = first.records
    # 10 ms per step: r0 prefills and samples at 0-10 ms, decodes at 10-20 and 20-30 ms.
    assert (r0.first_scheduled_s, r0.first_token_s, r0.last_token_s) == pytest.approx((0.0, 0.01, 0.03))
    assert r0.itls_s == pytest.approx([0.01, 0.01])
    # r1 arrived at 1 ms and waited for r0 (max_num_seqs=1): admitted at 30 ms.
    assert r1.queue_wait_s == pytest.approx(0.029) and r1.ttft_s == pytest.approx(0.039)
    assert first.duration_s == pytest.approx(0.05)


def test_measured_virtual_clock_skips_idle_time(tiny_checkpoint: Checkpoint) -> None:
    # A gap of 100 s between arrivals costs no real time on the virtual clock.
    trace = [crafted(0, 0.0, max_tokens=3), crafted(1, 100.0, max_tokens=3)]
    run = replay(tiny_checkpoint, "fcfs", trace, clock="virtual", max_num_seqs=4)
    assert run.wall_s < 30
    for record in run.records:
        assert record.success and record.output_len == 3
        assert record.ttft_s is not None and record.ttft_s > 0
        assert record.e2el_s == pytest.approx(record.ttft_s + sum(record.itls_s))
    assert run.records[1].first_scheduled_s == pytest.approx(100.0)  # admitted on arrival, the engine idle
    assert run.timeline and all(0 <= p.kv_usage <= 1 for p in run.timeline)


def test_real_clock_honours_arrival_times(tiny_checkpoint: Checkpoint) -> None:
    trace = [crafted(i, i * 0.05, max_tokens=2) for i in range(3)]
    run = replay(tiny_checkpoint, "fcfs", trace, clock="real", max_num_seqs=4)
    for request, record in zip(trace, run.records):
        assert record.arrival_s == pytest.approx(request.arrival_s)
        assert record.first_scheduled_s is not None and record.first_scheduled_s >= request.arrival_s - 1e-3
    assert run.duration_s >= 0.1


def test_virtual_clock_runs_only_inside_steps() -> None:
    clock = VirtualClock()
    assert clock() == 0
    clock.advance_to(50)
    clock.advance_to(10)  # never backwards
    assert clock() == 50
    with clock.step(cost=True):  # cost mode: still until the forward moves it on
        assert (clock(), clock()) == (50, 50)
        clock.advance_by(7)
        assert clock() == 57
    assert clock() == 57


def test_refused_request_is_a_failure_not_a_crash(tiny_checkpoint: Checkpoint) -> None:
    trace = [crafted(0, 0.0, max_tokens=2), crafted(1, 0.0, prompt_len=2000)]
    run = replay(tiny_checkpoint, "fcfs", trace)
    assert run.records[0].success
    assert not run.records[1].success and "prompt" in run.records[1].error


def test_hf_baseline_batches_statically(tiny_checkpoint: Checkpoint, tiny_model_dir: Path) -> None:
    from tokenloop.bench.replay_hf import load_hf_model

    trace = [crafted(0, 0.0, max_tokens=6), crafted(1, 0.0, max_tokens=2), crafted(2, 0.001, max_tokens=3)]
    run = replay_hf_static(trace, load_hf_model(str(tiny_model_dir)), tiny_checkpoint.tokenizer, batch_size=2,
                           progress=False)
    first, second, third = run.records
    assert [r.output_len for r in run.records] == [6, 2, 3]
    assert first.first_scheduled_s == second.first_scheduled_s == 0.0
    # Nobody joins a running batch: r2 waits until the longest of the first batch is done.
    assert third.first_scheduled_s is not None and first.last_token_s is not None
    assert third.first_scheduled_s >= first.last_token_s
    assert second.last_token_s is not None and second.last_token_s < first.last_token_s


def test_report_is_self_contained_with_a_plot_per_section(tiny_checkpoint: Checkpoint) -> None:
    trace = [crafted(i, i / 200, priority=i % 2, user=f"u{i % 3}", max_tokens=3 + i % 4) for i in range(10)]
    config = PolicyBenchConfig(policies=("fcfs", "sjf"), model=str(tiny_checkpoint.path),
                               engine_options=dict(SERIAL, max_num_seqs=4), clock="cost", step_cost=StepCost(5.0),
                               slos_ms={"ttft": 100.0}, progress=False)
    result = run_policy_benchmark(trace, config, checkpoint=tiny_checkpoint)
    page = render_html(result.runs, result.summaries, settings={"trace": "crafted"}, with_goodput=True)
    assert not re.search(r"https?://", page)
    assert "<script" not in page and "<link" not in page and "@import" not in page
    sections = dict(re.findall(r'<section id="([\w-]+)">(.*?)</section>', page, flags=re.S))
    assert set(sections) == {"summary", "ttft-cdf", "queue", "kv", "gantt", "breakdown"}
    assert "<table" in sections["summary"] and "Request goodput (req/s)" in sections["summary"]
    for name in ("ttft-cdf", "queue", "kv", "gantt", "breakdown"):
        assert "<svg" in sections[name], name
    assert sections["gantt"].count("<svg") == 2  # one Gantt per policy
    assert sections["gantt"].count("<rect") > 3 * len(trace)  # queue / prefill / decode bars
    assert "priority 1" in sections["breakdown"] and "user u2" in sections["breakdown"]


def test_report_of_a_long_run_keeps_a_bounded_gantt_and_cdf() -> None:
    from tokenloop.bench import charts

    records = [ReplayRecord(id=f"r{i}", arrival_s=i * 1e-3, prompt_len=4, max_tokens=2,
                            first_scheduled_s=i * 1e-3, first_token_s=i * 1e-3 + 0.01, last_token_s=i * 1e-3 + 0.02,
                            finished_s=i * 1e-3 + 0.02, output_len=2, finish_reason="length")
               for i in range(3 * charts.MAX_GANTT_REQUESTS + 1)]
    run = ReplayRun(label="long", kind="engine", records=records)
    gantt = charts.gantt_chart(run)
    rows = gantt.count("<title>r") / 3  # queue, prefill, decode bars per request drawn
    assert charts.MAX_GANTT_REQUESTS / 2 <= rows <= charts.MAX_GANTT_REQUESTS and "<title>r0 queue" in gantt
    values = [float(i) for i in range(10 * charts.MAX_CDF_POINTS + 7)]
    xs, ys = charts.cdf(values)
    assert len(xs) == charts.MAX_CDF_POINTS and xs[0] == 0.0 and xs[-1] == values[-1] and ys[-1] == 1.0
    assert charts.cdf([3.0, 1.0, 2.0]) == ([1.0, 2.0, 3.0], [1 / 3, 2 / 3, 1.0])  # short: every point


def test_policies_command_prints_table_and_writes_outputs(tiny_model_dir: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    trace = [crafted(i, i / 100, priority=i % 2, user=f"u{i % 2}", max_tokens=2 + i % 3) for i in range(6)]
    (tmp_path / "t.jsonl").write_text(dumps_trace(trace))
    code = main(["policies", "--trace", str(tmp_path / "t.jsonl"), "--policies", "fcfs,priority",
                 "--model", str(tiny_model_dir), "--max-num-seqs", "2", "--num-kv-blocks", "64", "--block-size", "4",
                 "--clock", "cost", "--step-cost-ms", "5:0.1", "--goodput", "ttft:50",
                 "--report", str(tmp_path / "r.html"), "--save-result", str(tmp_path / "r.json"), "--disable-tqdm"])
    assert code == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "fcfs" in line and "priority" in line)
    assert header.split() == ["fcfs", "priority"]
    for label in ("Request throughput (req/s)", "Request goodput (req/s)", "P99 TTFT (ms)", "Mean queue wait (ms)",
                  "P50 ITL (ms)", "P99 E2EL (ms)", "Preemptions", "Prefix cache hit rate (%)", "user u1"):
        assert label in out, label
    saved = json.loads((tmp_path / "r.json").read_text())
    assert [run["label"] for run in saved["runs"]] == ["fcfs", "priority"]
    assert saved["settings"]["step_cost_ms"] == [5.0, 0.1]
    assert len(saved["runs"][0]["requests"]) == 6 and saved["runs"][0]["timeline"]
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")


def test_bench_subparser_wires_into_a_parent_command_line(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="tokenloop")
    add_bench_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "policies", "--trace", "t.jsonl", "--policies", "sjf"])
    assert args.func is run_policies_command and args.policies == "sjf" and args.clock == "virtual"
    args = parser.parse_args(["bench", "make-trace", "--out", str(tmp_path / "t.jsonl"), "--num-requests", "3"])
    assert args.func(args) == 0 and (tmp_path / "t.jsonl").exists()


def test_option_parsers() -> None:
    assert parse_step_cost("10") == StepCost(10.0, 0.0)
    assert parse_step_cost("2:0.5") == StepCost(2.0, 0.5)
    with pytest.raises(ValueError):
        parse_step_cost("0")
    assert parse_base_urls(["http://h:1"], ["sjf"]) == {"sjf": "http://h:1"}
    assert parse_base_urls(["fcfs=http://a", "sjf=http://b"], ["fcfs", "sjf"]) == {"fcfs": "http://a", "sjf": "http://b"}
    with pytest.raises(ValueError, match="one policy"):
        parse_base_urls(["http://h:1"], ["fcfs", "sjf"])
    with pytest.raises(ValueError, match="no --base-url for policy 'sjf'"):
        parse_base_urls(["fcfs=http://a"], ["fcfs", "sjf"])
