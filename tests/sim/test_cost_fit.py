"""NNLS recovers known coefficients; the fit never goes negative; profiles load or fail clearly."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from tokenloop.observe.records import ScheduledChunk, StepGauges, StepRecord
from tokenloop.sim.cost import (
    TERMS,
    StepCostModel,
    StepFeatures,
    WeightForms,
    features_of_record,
    fit,
    nnls,
)
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


# ---- weight forms: the packed kernels up to a row count, the dense copies above -------------------

FORMS = WeightForms(layers_packed_max_tokens=16, head_packed_max_rows=8)


def decode_step(rows: int, context: int = 100) -> list[tuple[int, int, bool]]:
    return [(context, 1, True)] * rows


def test_form_switches_put_a_steps_rows_in_the_form_it_runs() -> None:
    at_16 = features_of_record(synthetic_record(0, decode_step(16), 1), FORMS)
    assert (at_16.packed_tokens, at_16.tokens, at_16.dense_layers) == (16, 0, 0)  # 16 tokens: still packed
    assert (at_16.sampled_rows, at_16.packed_sampled_rows, at_16.dense_head) == (16, 0, 1)  # 16 > 8 rows
    mixed = features_of_record(synthetic_record(0, [*decode_step(8), (0, 9, False)], 1), FORMS)
    assert (mixed.packed_tokens, mixed.tokens, mixed.dense_layers) == (0, 17, 1)  # 17 tokens: the dense copy
    assert (mixed.sampled_rows, mixed.packed_sampled_rows, mixed.dense_head) == (0, 8, 0)  # 8 rows: packed head
    # One form at every size (no switches): everything in tokens and sampled_rows, the form terms 0.
    plain = features_of_record(synthetic_record(0, [*decode_step(8), (0, 9, False)], 1))
    assert (plain.tokens, plain.sampled_rows) == (17, 8)
    assert plain.packed_tokens == plain.dense_layers == plain.packed_sampled_rows == plain.dense_head == 0


def test_nnls_recovers_per_form_costs_that_one_linear_model_cannot_fit() -> None:
    # Packed rows cost more each but read fewer bytes: the cost jumps down at 17 tokens and up at 9 rows.
    truth = StepCostModel(step=0.008, tokens=3e-4, packed_tokens=2e-3, dense_layers=0.02, kv_read_tokens=1e-5,
                          prefill_attn=1e-7, sampled_rows=2e-4, packed_sampled_rows=4e-4, dense_head=0.004,
                          seqs=1e-4, forms=FORMS)
    rng = random.Random(0)
    records = []
    for i in range(300):  # decodes of every size, and a prompt's chunk next to some of them
        chunks = decode_step(rng.randint(1, 16), rng.choice([40, 200]))
        if rng.random() < 0.4:
            chunks.append((0, rng.choice([4, 8, 24, 96, 300]), rng.random() < 0.5))
        records.append(synthetic_record(i, chunks, truth.step_ns(features_of_record(synthetic_record(0, chunks, 1),
                                                                                    FORMS))))
    report = fit(records, forms=FORMS)
    assert report.model.forms == FORMS
    for name in TERMS:
        assert getattr(report.model, name) == pytest.approx(getattr(truth, name), rel=1e-3, abs=1e-9)
    # The old terms draw one line through both forms: small steps on the dense copy are far off.
    old = fit(records, trim=None).model
    for chunks in ([*decode_step(16), (0, 1, False)], [*decode_step(2), (0, 24, True)]):
        step = synthetic_record(0, chunks, 1)
        assert abs(old.step_seconds(features_of_record(step)) / truth.step_seconds(features_of_record(step, FORMS))
                   - 1) > 0.15


def test_fit_takes_explicit_durations_one_per_record() -> None:
    records = [synthetic_record(i, decode_step(b), 1_000_000) for i, b in enumerate([1, 2, 4, 8, 12, 16] * 3)]
    periods = [0.002 + 0.001 * len(r.scheduled) for r in records]  # the loop's period, not the 1 ms bodies
    model = fit(records, terms=("step", "seqs"), durations=periods).model
    assert (model.step, model.seqs) == (pytest.approx(0.002), pytest.approx(0.001))
    with pytest.raises(ValueError, match="3 durations for 18 records"):
        fit(records, durations=periods[:3])


def test_profiles_keep_their_form_switches_and_old_ones_load_with_the_new_terms_at_zero(tmp_path) -> None:
    import json

    from tokenloop.sim.profiles import FitReport, Profile, fitted_profile

    model = StepCostModel(step=0.01, packed_tokens=2e-3, dense_layers=0.02, forms=FORMS)
    document = fitted_profile("p", "m", "h", 8192, 1024, 16, FitReport(model, 10, 12, 0.05, 0.02), "cmd", "now")
    assert document["cost"]["forms"] == {"layers_packed_max_tokens": 16, "head_packed_max_rows": 8}
    loaded = Profile.from_json(json.loads(json.dumps(document))).cost_model
    assert loaded == model
    # A profile written before the form terms existed (the CPU profile as shipped on 2026-12-01) still loads.
    older = load_profile(str(Path(__file__).parent / "data" / "profile-without-forms.json")).cost_model
    assert older.forms == WeightForms() and older.packed_tokens == older.dense_head == 0
    assert older.step > 0 and older.tokens > 0
    for forms, message in (({"layers_max": 16}, "unknown weight form switch 'layers_max'"),
                           ({"head_packed_max_rows": -1}, "head_packed_max_rows")):
        path = tmp_path / "bad-forms.json"
        path.write_text(json.dumps({**document, "cost": {**document["cost"], "forms": forms}}))
        with pytest.raises(ProfileError, match=message):
            load_profile(str(path))
