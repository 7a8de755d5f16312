"""A short soak on the tiny model: mixed requests, 30% disconnects, a pool too small for the load."""

from __future__ import annotations

from pathlib import Path

from tokenloop.bench.soak import SoakConfig, main, run_soak


def test_short_soak_passes(tiny_model_dir: Path) -> None:
    report = run_soak(SoakConfig(model=str(tiny_model_dir), num_requests=120, disconnect_fraction=0.3,
                                 concurrency=24, max_tokens=32, num_kv_blocks=48, block_size=4, seed=1))
    assert report.ok, report.summary()
    assert report.outcomes["disconnected"] > 0 and report.outcomes["completed"] > 0
    assert report.engine["preemptions"] > 0  # the pool really was too small
    assert report.engine["finished"].get("abort", 0) >= report.outcomes["disconnected"] * 0.5
    # A client may drop before its request reaches the engine; every other request was accepted.
    assert report.engine["accepted"] >= report.outcomes["completed"] + report.outcomes["disconnected"] * 0.5
    assert report.engine["accepted"] <= 120


def test_soak_cli_exit_status(tiny_model_dir: Path, capsys) -> None:
    assert main(["--model", str(tiny_model_dir), "--num-requests", "10", "--num-kv-blocks", "48",
                 "--block-size", "4", "--max-tokens", "8"]) == 0
    assert "result: PASS" in capsys.readouterr().out


def test_soak_with_hostile_clients_and_injected_faults_has_no_collateral_failure(tiny_model_dir: Path) -> None:
    report = run_soak(SoakConfig(model=str(tiny_model_dir), num_requests=100, disconnect_fraction=0.2,
                                 concurrency=24, max_tokens=16, num_kv_blocks=48, block_size=4, seed=2,
                                 hostile_fraction=0.15, fault_fraction=0.1))
    assert report.ok, report.summary()  # every hostile client got a 4xx; no unmarked request failed
    assert sum(v for k, v in report.outcomes.items() if k.startswith("rejected_4")) > 0
    assert report.outcomes["failed_by_injected_fault"] > 0
    assert report.outcomes["collateral_failure"] == 0
    assert report.engine["kv_usage"] == 0.0 and report.engine["unfinished"] == 0
