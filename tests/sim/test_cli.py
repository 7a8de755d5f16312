"""`tokenloop simulate` end to end on a tiny trace: the table, the saved result, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenloop.bench.trace import TraceRequest, write_trace
from tokenloop.cli.main import main


def tiny_trace(path: Path) -> Path:
    write_trace([TraceRequest(id=f"r{i}", arrival_s=i * 0.002, max_tokens=3 + i % 4,
                              prompt_tokens=tuple(range(5 + i, 25 + i)), user=f"u{i % 2}")
                 for i in range(10)], path)
    return path


def test_simulate_prints_the_policy_table_and_saves_the_result(tmp_path: Path, capsys) -> None:
    trace = tiny_trace(tmp_path / "t.jsonl")
    out = tmp_path / "r.json"
    rc = main(["simulate", "--trace", str(trace), "--profile", "h100-llama3-8b", "--policies", "fcfs,sjf",
               "--save-result", str(out), "--report", str(tmp_path / "r.html"), "--disable-tqdm"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Policy comparison" in text and "fcfs" in text and "sjf" in text
    document = json.loads(out.read_text())
    assert [run["label"] for run in document["runs"]] == ["fcfs", "sjf"]
    assert document["settings"]["clock"] == "simulated"
    for run in document["runs"]:
        settings = run["settings"]
        assert settings["profile"] == "h100-llama3-8b"
        busy = settings["modelled_busy_s"]
        assert abs(sum(settings["bound_s"].values()) - busy) < 1e-9 and busy > 0
        assert settings["bound_steps"]["bandwidth"] == run["num_steps"]  # small batches: weight-bound
        assert abs(settings["energy_j"] - 700.0 * busy) < 1e-6
        assert [r["output_len"] for r in run["requests"]] == [3 + i % 4 for i in range(10)]
    assert (tmp_path / "r.html").read_text().startswith("<!")


def test_simulate_profiles_lists_the_shipped_ones(capsys) -> None:
    assert main(["simulate", "profiles"]) == 0
    text = capsys.readouterr().out
    assert "h100-llama3-8b" in text and "cpu-smollm2-135m" in text


def test_an_unknown_profile_names_the_known_ones(tmp_path: Path, caplog) -> None:
    trace = tiny_trace(tmp_path / "t.jsonl")
    assert main(["simulate", "--trace", str(trace), "--profile", "nope"]) == 2
    assert "unknown profile 'nope'" in caplog.text and "h100-llama3-8b" in caplog.text


def test_a_malformed_trace_line_names_the_file_line_and_field(tmp_path: Path, caplog) -> None:
    trace = tiny_trace(tmp_path / "t.jsonl")
    trace.write_text(trace.read_text() + '{"arrival_s": 1.0, "prompt_tokens": [1], "max_tokens": 0}\n')
    assert main(["simulate", "--trace", str(trace), "--profile", "h100-llama3-8b"]) == 2
    assert f"{trace} line 11, field 'max_tokens'" in caplog.text


@pytest.mark.parametrize("argv", [["simulate"], ["simulate", "calibrate", "--batches", "0"],
                                  ["simulate", "calibrate", "--contexts", "a,b"]])
def test_missing_arguments_are_errors(argv: list[str]) -> None:
    assert main(argv) == 2


def test_a_profile_for_another_block_size_is_refused(tmp_path: Path, caplog) -> None:
    trace = tiny_trace(tmp_path / "t.jsonl")
    assert main(["simulate", "--trace", str(trace), "--profile", "h100-llama3-8b", "--block-size", "32"]) == 2
    assert "is for block size 16, not 32" in caplog.text


def test_calibrate_fits_a_profile_that_simulate_then_runs(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "tiny-cpu.json"
    assert main(["simulate", "calibrate", "--model", str(tiny_model_dir), "--batches", "1,3",
                 "--contexts", "8,40", "--decode-tokens", "4", "--out", str(out)]) == 0
    profile = json.loads(out.read_text())
    assert profile["source"].startswith("tokenloop simulate calibrate --model")
    assert all(v >= 0 for v in profile["cost"]["coefficients"].values())
    trace = tiny_trace(tmp_path / "t.jsonl")
    assert main(["simulate", "--trace", str(trace), "--profile", str(out), "--policies", "fcfs",
                 "--disable-tqdm"]) == 0
