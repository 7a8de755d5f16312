"""`simulate validate` end to end at tiny scale (the tiny random model, one real run per cell), and the
comparison rule on its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenloop.cli.main import main
from tokenloop.cli.simulate_validate import METRICS, compare

SWEEP = ["--batches", "1,3", "--contexts", "8,40", "--decode-tokens", "4"]


def test_the_goal_is_max_of_10_percent_and_2_sigma() -> None:
    tight = compare(105.0, [100.0, 100.0, 100.0])  # std 0: 10% of 100 = 10
    assert tight["pass"] and tight["tolerance"] == pytest.approx(10.0) and tight["rel_error"] == pytest.approx(0.05)
    assert not compare(111.0, [100.0, 100.0, 100.0])["pass"]
    noisy = compare(130.0, [80.0, 100.0, 120.0])  # std 20: 2 sigma = 40
    assert noisy["pass"] and noisy["tolerance"] == pytest.approx(40.0)
    assert compare(0.0, [0.0])["pass"] and not compare(2.0, [0.0])["pass"]  # zero preemptions must stay zero
    assert compare(None, [1.0])["pass"] is None and compare(1.0, [None])["pass"] is None


def test_validate_runs_real_and_simulated_and_reports_every_metric(tmp_path: Path, tiny_model_dir: Path,
                                                                   capsys) -> None:
    out, markdown = tmp_path / "v.json", tmp_path / "v.md"
    assert main(["simulate", "validate", "--model", str(tiny_model_dir), *SWEEP, "--runs", "1",
                 "--loads", "0.5,1.2", "--num-requests", "6", "--output-len", "3:6", "--prompt-len-median", "12",
                 "--max-prompt-len", "40", "--capacity-requests", "4", "--clock", "virtual",
                 "--num-kv-blocks", "12", "--block-size", "16", "--save-result", str(out),
                 "--markdown", str(markdown)]) == 0
    captured = capsys.readouterr()
    assert "calibrating" in captured.err  # the profile came from the calibration sweep, not the runs
    assert "real mean ± std" in captured.out and "comparisons pass" in captured.out
    document = json.loads(out.read_text())
    assert document["profile"]["calibration"]["model"] == str(tiny_model_dir)
    assert set(document["capacity"]) == {"sharegpt", "prefix"}
    assert all(c["from"] == "real" and c["requests_per_s"] > 0 for c in document["capacity"].values())
    assert [(c["workload"], c["load"]) for c in document["cells"]] == [
        ("sharegpt", 0.5), ("sharegpt", 1.2), ("prefix", 0.5), ("prefix", 1.2)]
    for cell in document["cells"]:
        assert set(cell["metrics"]) == {key for key, _, _ in METRICS}
        for metric in cell["metrics"].values():
            assert len(metric["real_runs"]) == 1 and metric["simulated"] is not None
            assert metric["pass"] in (True, False)
    assert document["compared"] == 4 * len(METRICS)
    assert markdown.read_text().count("\n| ") == 2 + 4 * len(METRICS)  # header, rule, rows


def test_bad_validate_options_are_errors(tiny_model_dir: Path, capsys, caplog) -> None:
    assert main(["simulate", "validate", "--model", str(tiny_model_dir), "--workloads", "nope"]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err
    assert main(["simulate", "validate", "--loads", "0.5,x"]) == 2
    assert main(["simulate", "validate", "--profile", "h100-llama3-8b", "--model", str(tiny_model_dir)]) == 2
    assert "made for model 'meta-llama/Meta-Llama-3-8B'" in caplog.text  # both named, before any run
