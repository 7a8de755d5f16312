"""NNLS recovers known coefficients; the fit never goes negative; profiles load or fail clearly."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tokenloop.observe.records import ScheduledChunk, StepGauges, StepRecord
from tokenloop.sim.cost import TERMS, StepCostModel, StepFeatures, features_of_record, fit, nnls
from tokenloop.sim.profiles import ProfileError, load_profile, shipped_profiles


def synthetic_record(index: int, chunks: list[tuple[int, int, bool]], duration_ns: int) -> StepRecord:
    scheduled = [ScheduledChunk(f"r{i}", start, q, start + q, samples, [], 0, 0, False, 1)
                 for i, (start, q, samples) in enumerate(chunks)]
    gauges = StepGauges(0, 0, 0, 1, 16, 1, 0, 0, 0, 0, 0)
    return StepRecord(index, 0, 0, duration_ns, duration_ns, duration_ns, 0, duration_ns, 0,
                      sum(q for _, q, _ in chunks), scheduled, [], [], [], [], gauges)


def test_nnls_recovers_known_coefficients_from_synthetic_records() -> None:
    truth = StepCostModel(step=0.02, tokens=3e-4, kv_read_tokens=2e-6, prefill_attn=0.0, sampled_rows=5e-4,
                          seqs=1e-4)
    rng = random.Random(0)
    records = []
    for i in range(200):  # a grid of batch x context x chunk, as a calibration sweep makes
        batch = rng.choice([1, 2, 4, 8, 16])
        chunks = [(rng.choice([0, 32, 128, 512]), rng.choice([1, 1, 1, 16, 64]), rng.random() < 0.9)
                  for _ in range(batch)]
        duration = truth.step_ns(features_of_record(synthetic_record(0, chunks, 1)))
        records.append(synthetic_record(i, chunks, duration))
    report = fit(records)
    for name in TERMS:
        assert getattr(report.model, name) == pytest.approx(getattr(truth, name), rel=1e-3, abs=1e-9)
    assert report.median_abs_rel_error < 1e-6


def test_nnls_meets_the_kkt_conditions_where_plain_least_squares_goes_negative() -> None:
    rng = np.random.default_rng(1)
    a = rng.random((40, 5))
    a[:, 4] = a[:, 3] * 1.0001 + 1e-4 * rng.random(40)  # nearly collinear: ill-conditioned
    b = a @ np.array([1.0, 0.0, 2.0, 0.5, 0.0]) + 0.01 * rng.standard_normal(40)
    x = nnls(a, b)
    assert (x >= 0).all()
    gradient = a.T @ (a @ x - b)
    assert np.all(gradient[x > 0] == pytest.approx(0.0, abs=1e-6))  # stationary where free
    assert (gradient[x == 0] >= -1e-6).all()  # would only get worse moving up from 0
    assert np.linalg.lstsq(a, b, rcond=None)[0].min() < 0  # what an unconstrained fit would have done


def test_cost_models_refuse_negative_coefficients() -> None:
    with pytest.raises(ValueError, match="tokens"):
        StepCostModel(step=0.01, tokens=-1.0)
    with pytest.raises(ValueError, match="unknown cost term"):
        StepCostModel.from_dict({"steps": 1.0})


def test_shipped_profiles_load_and_an_unknown_one_lists_them() -> None:
    names = shipped_profiles()
    assert {"h100-llama3-8b", "cpu-smollm2-135m"} <= set(names)
    for name in names:
        profile = load_profile(name)
        assert profile.source and profile.sources
    with pytest.raises(ProfileError, match="unknown profile 'a100-nope'.*h100-llama3-8b"):
        load_profile("a100-nope")


def test_the_h100_profile_prices_a_batch_1_decode_step_near_published_numbers() -> None:
    h100 = load_profile("h100-llama3-8b").cost_model
    one = h100.step_seconds(StepFeatures(tokens=1, kv_read_tokens=512, sampled_rows=1, seqs=1))
    assert 0.0045 < one < 0.015  # 7-8B decode steps on H100: 5-15 ms published; 4.8 ms roofline
    decode = StepFeatures(tokens=1, kv_read_tokens=512, sampled_rows=1, seqs=1)
    assert h100.critical_path(decode) == "bandwidth"
    assert h100.critical_path(StepFeatures(tokens=4096, sampled_rows=1, seqs=1)) == "compute"


def test_a_broken_profile_file_names_the_field(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"name": "bad", "model": "m", "hardware": "h", "max_model_len": 8}')
    with pytest.raises(ProfileError, match="missing field 'cost'"):
        load_profile(str(path))


def test_overheads_add_outside_the_roofline_and_unknown_ones_are_refused() -> None:
    features = StepFeatures(step=1, tokens=10, kv_read_tokens=100)
    base = StepCostModel(step=1e-3, tokens=2e-4, kv_read_tokens=1e-6, combine="max")
    with_overheads = StepCostModel.from_dict(base.as_dict(), "max", {"step": 5e-4, "tokens": 1e-5})
    # max(1e-3 + 1e-4, 2e-3) + 5e-4 + 10 x 1e-5
    assert with_overheads.step_seconds(features) == pytest.approx(2e-3 + 5e-4 + 1e-4)
    assert with_overheads.step_seconds(features) - base.step_seconds(features) == pytest.approx(6e-4)
    assert with_overheads.critical_path(features) == "compute"  # overheads do not move the roofline
    with pytest.raises(ValueError, match="unknown overhead 'seqs'"):
        StepCostModel.from_dict(base.as_dict(), "max", {"seqs": 1.0})
    with pytest.raises(ValueError, match="overhead_step"):
        StepCostModel(step=1e-3, overhead_step=-1.0)
