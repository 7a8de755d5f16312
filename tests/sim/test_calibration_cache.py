"""The calibration cache: keyed by machine, model, dtype and block size; written by `simulate calibrate`,
used (or filled once) by `simulate` without --profile; a profile for another key is refused, both named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.sim.test_cli import tiny_trace
from tokenloop.cli.main import main
from tokenloop.sim.profiles import (
    CalibrationKey,
    ProfileError,
    cached_profile,
    this_machine,
)

SWEEP = ["--batches", "1,3", "--contexts", "8,40", "--decode-tokens", "4", "--mixed-batches", "2",
         "--mixed-prompts", "8"]


def test_keys_differ_by_each_field_and_name_this_machine() -> None:
    base = CalibrationKey.here("m")
    assert base.machine == this_machine() and "cores" in base.machine
    others = [CalibrationKey(base.machine + "!", "m", "auto", 16), CalibrationKey.here("m2"),
              CalibrationKey.here("m", "float32"), CalibrationKey.here("m", block_size=32),
              CalibrationKey(base.machine, "m", "auto", 16, engine=base.engine + "!"),
              CalibrationKey.here("m", kv_cache_dtype="bfloat16"), CalibrationKey.here("m", kv_cache_dtype="float32")]
    assert len({k.filename() for k in [base, *others]}) == 8


def test_the_engine_fingerprint_follows_the_step_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed kernel or runner names another cached profile: the old engine's costs are never reused."""
    from tokenloop.sim import profiles

    package = tmp_path / "tokenloop"
    (package / "model" / "csrc").mkdir(parents=True)
    (package / "sim").mkdir()
    kernel = package / "model" / "csrc" / "k.cpp"
    kernel.write_text("int a;")
    (package / "runner.py").write_text("x = 1")
    monkeypatch.setattr(profiles, "__file__", str(package / "sim" / "profiles.py"))
    first = profiles.engine_fingerprint()
    assert profiles.engine_fingerprint() == first  # deterministic
    kernel.write_text("int b;")
    second = profiles.engine_fingerprint()
    (package / "runner.py").write_text("x = 2")
    assert len({first, second, profiles.engine_fingerprint()}) == 3


def test_calibrate_caches_and_simulate_without_profile_uses_it(tmp_path: Path, tiny_model_dir: Path,
                                                                profile_cache: Path, capsys) -> None:
    assert main(["simulate", "calibrate", "--model", str(tiny_model_dir), *SWEEP]) == 0
    key = CalibrationKey.here(str(tiny_model_dir))
    assert key.path().parent == profile_cache and key.path().is_file()
    profile = cached_profile(key)
    assert profile.calibration == key.as_dict() and profile.model == str(tiny_model_dir)
    assert profile.source.startswith("tokenloop simulate calibrate --model")
    before = key.path().stat().st_mtime_ns
    capsys.readouterr()
    out = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(tiny_trace(tmp_path / "t.jsonl")), "--model", str(tiny_model_dir),
                 "--policies", "fcfs", "--disable-tqdm", "--save-result", str(out)]) == 0
    assert "calibrating" not in capsys.readouterr().err  # the cached one, no second sweep
    assert key.path().stat().st_mtime_ns == before
    assert json.loads(out.read_text())["runs"][0]["settings"]["profile"] == key.path().stem


def test_simulate_without_a_cached_profile_calibrates_once(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    trace = str(tiny_trace(tmp_path / "t.jsonl"))
    argv = ["simulate", "--trace", trace, "--model", str(tiny_model_dir), "--policies", "fcfs", "--disable-tqdm",
            *SWEEP]
    assert main(argv) == 0
    assert "calibrating" in capsys.readouterr().err
    assert CalibrationKey.here(str(tiny_model_dir)).path().is_file()
    assert main(argv) == 0
    assert "calibrating" not in capsys.readouterr().err


def test_a_cached_profile_for_another_key_is_refused_with_both_named(tiny_model_dir: Path) -> None:
    key = CalibrationKey.here("model-a")
    key.path().parent.mkdir(parents=True)
    shipped = json.loads((Path(__file__).parents[2] / "tokenloop/sim/profiles/cpu-smollm2-135m.json").read_text())
    key.path().write_text(json.dumps({**shipped, "calibration": {**key.as_dict(), "model": "model-b"}}))
    with pytest.raises(ProfileError, match="calibrated for model 'model-b', not 'model-a'"):
        cached_profile(key)


def test_a_profile_for_another_model_is_refused_with_both_named(tmp_path: Path, caplog) -> None:
    trace = str(tiny_trace(tmp_path / "t.jsonl"))
    assert main(["simulate", "--trace", trace, "--profile", "h100-llama3-8b", "--model", "other-model"]) == 2
    assert "made for model 'meta-llama/Meta-Llama-3-8B', not 'other-model'" in caplog.text
