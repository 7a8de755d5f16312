"""Energy per request: a step's energy split by token share; the requests' energies add up to the run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.sim.test_cli import tiny_trace
from tests.sim.test_cost_fit import synthetic_record
from tokenloop.cli.main import main
from tokenloop.sim.energy import StepEnergy


def test_a_step_is_shared_by_its_requests_share_of_its_tokens() -> None:
    energy = StepEnergy(power_watts=100.0)
    record = synthetic_record(0, [(0, 10, True), (40, 1, True)], duration_ns=10**9)  # 1 s: 100 J
    record.forward_ns = 10**9
    energy.on_step(record)
    energy.on_step(synthetic_record(1, [], duration_ns=5))  # an empty step costs nothing
    assert energy.by_request["r0"] == pytest.approx(100.0 * 10 / 11)
    assert energy.by_request["r1"] == pytest.approx(100.0 / 11)
    assert energy.total_j == pytest.approx(100.0)
    with pytest.raises(ValueError, match="power_watts"):
        StepEnergy(0.0)


@pytest.mark.parametrize("extra", [[], ["--replicas", "2", "--router", "round-robin"]])
def test_per_request_energy_sums_to_the_run_and_is_tabled(tmp_path: Path, capsys, extra: list[str]) -> None:
    trace = tiny_trace(tmp_path / "t.jsonl")
    out = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(trace), "--profile", "h100-llama3-8b", "--policies", "fcfs",
                 "--save-result", str(out), "--disable-tqdm", *extra]) == 0
    assert "Energy per request: mean (J)" in capsys.readouterr().out
    for run in json.loads(out.read_text())["runs"]:
        energies = [r["energy_j"] for r in run["requests"]]
        assert all(e > 0 for e in energies)
        assert sum(energies) == pytest.approx(run["settings"]["energy_j"], rel=1e-6)
        summary = run["settings"]["energy_per_request"]
        assert summary["total_j"] == pytest.approx(sum(energies))
        assert summary["p50_j"] <= summary["p90_j"] <= summary["max_j"]


def test_a_profile_without_power_has_no_energy(tmp_path: Path, capsys) -> None:
    trace = tiny_trace(tmp_path / "t.jsonl")
    out = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(trace), "--profile", "cpu-smollm2-135m", "--policies", "fcfs",
                 "--save-result", str(out), "--disable-tqdm"]) == 0
    assert "Energy" not in capsys.readouterr().out
    run = json.loads(out.read_text())["runs"][0]
    assert all(r["energy_j"] is None for r in run["requests"])
