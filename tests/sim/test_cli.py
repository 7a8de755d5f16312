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
    assert "--passes 3" in profile["source"]
    assert all(v >= 0 for v in profile["cost"]["coefficients"].values())
    fit = profile["fit"]  # three passes of the sweep, the median one kept
    assert fit["passes"] == 3 and len(fit["pass_levels"]) == 3 and fit["pass_levels"][fit["chosen_pass"]] == 1.0
    assert sorted(fit["pass_levels"])[1] == 1.0
    trace = tiny_trace(tmp_path / "t.jsonl")
    assert main(["simulate", "--trace", str(trace), "--profile", str(out), "--policies", "fcfs",
                 "--disable-tqdm"]) == 0


def test_the_mixed_sweep_runs_chunks_next_to_decodes_and_every_decode_batch_size(tiny_model_dir: Path) -> None:
    from tokenloop.cli.simulate_calibrate import calibration_records

    records, periods, _ = calibration_records(str(tiny_model_dir), [1], [8], 2, mixed_batches=[3, 9],
                                              mixed_prompts=[4, 40])
    mixed = {sum(c.num_tokens == 1 for c in r.scheduled) for r in records
             if any(c.num_tokens == 1 for c in r.scheduled) and any(c.num_tokens > 1 for c in r.scheduled)}
    assert {3, 9} <= mixed  # each arriving prompt's chunk ran next to the batch decoding
    decodes = {len(r.scheduled) for r in records if all(c.num_tokens == 1 for c in r.scheduled)}
    assert {1, 3, 4, 9, 10} <= decodes  # the batch alone, and with the arrival decoding too
    assert {c.request_id.split("-")[0] for r in records for c in r.scheduled} == {"b1", "m3", "m9"}
    # A step's period runs to the next step's start: its body, and the loop's processing after it. Where the
    # sweep adds requests next (9 times here) it is the body and the loop's median gap instead.
    assert len(periods) == len(records)
    assert all(p >= (r.end_ns - r.start_ns) / 1e9 for r, p in zip(records, periods))
    to_next = [p == pytest.approx((b.start_ns - a.start_ns) / 1e9, abs=1e-9)
               for a, b, p in zip(records, records[1:], periods)]
    assert sum(to_next) >= len(records) - 9


def test_weight_forms_are_read_off_the_loaded_model(tiny_model_dir: Path) -> None:
    from types import SimpleNamespace

    from tokenloop.cli.simulate_calibrate import weight_forms
    from tokenloop.sim.cost import WeightForms

    head = SimpleNamespace(weight=SimpleNamespace(form_for=lambda rows: "q8_0" if rows <= 8 else "float32"))
    model = SimpleNamespace(weight_form=lambda rows: "int4" if rows <= 16 else "bfloat16", lm_head=head)
    assert weight_forms(model) == WeightForms(layers_packed_max_tokens=16, head_packed_max_rows=8)
    dense = SimpleNamespace(weight_form=lambda rows: "float32", lm_head=SimpleNamespace(weight=object()))
    assert weight_forms(dense) == WeightForms()  # one form at every size


def test_calibrate_without_the_mixed_sweep_and_bad_mixed_lists(tmp_path: Path, tiny_model_dir: Path,
                                                               caplog) -> None:
    out = tmp_path / "plain.json"
    assert main(["simulate", "calibrate", "--model", str(tiny_model_dir), "--batches", "1,3", "--contexts", "8,40",
                 "--decode-tokens", "4", "--mixed-batches", "none", "--out", str(out)]) == 0
    assert "--mixed-batches none --mixed-prompts 8,24,96,320" in json.loads(out.read_text())["source"]
    assert main(["simulate", "calibrate", "--model", str(tiny_model_dir), "--mixed-prompts", "8,x"]) == 2


def test_calibration_keeps_the_fit_of_the_median_level_pass() -> None:
    from types import SimpleNamespace

    from tokenloop.cli.simulate_calibrate import median_level_pass
    from tokenloop.sim.cost import FitReport, StepCostModel

    def report(step_s: float) -> FitReport:
        return FitReport(StepCostModel(step=step_s, tokens=1e-4), 10, 10, 0.01, step_s)

    chunk = SimpleNamespace(start=5, num_tokens=1, samples=True)
    steps = [SimpleNamespace(scheduled=[chunk] * rows) for rows in (1, 4, 8)]
    # A pass measured while the machine ran fast (0.8x), one slow (1.3x), one between: the between one is kept.
    chosen, levels = median_level_pass([report(0.008), report(0.013), report(0.010)], steps)
    assert chosen == 2 and levels[2] == 1.0
    assert levels[0] < 1.0 < levels[1]
    assert median_level_pass([report(0.01)], steps) == (0, [1.0])
