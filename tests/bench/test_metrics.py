"""Benchmark metrics against hand-computed values (vLLM's definitions)."""

from __future__ import annotations

import pytest

from tokenloop.bench.metrics import (
    RequestRecord,
    compute_metrics,
    format_metrics,
    meets_slos,
    parse_goodput,
    result_json,
)


def _records() -> list[RequestRecord]:
    return [
        # 4 tokens: TPOT = (0.2 - 0.1) / 3
        RequestRecord(success=True, prompt_len=10, output_len=4, ttft_s=0.1, itls_s=[0.02, 0.03, 0.05], e2el_s=0.2),
        # 1 token: no TPOT (counted as 0 for goodput)
        RequestRecord(success=True, prompt_len=20, output_len=1, ttft_s=0.3, itls_s=[], e2el_s=0.3),
        # 3 tokens: TPOT = (0.25 - 0.05) / 2 = 0.1
        RequestRecord(success=True, prompt_len=5, output_len=3, ttft_s=0.05, itls_s=[0.1, 0.1], e2el_s=0.25),
        RequestRecord(success=False, prompt_len=7, error="HTTP 500"),
    ]


def test_aggregates_match_hand_computed_values() -> None:
    m = compute_metrics(_records(), duration_s=2.0, percentiles=(50, 99))
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (35, 8)  # the failed request's prompt is not counted
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(21.5)
    assert m.request_goodput is None  # no SLO given

    # TTFT over [50, 100, 300] ms; p99 interpolates between 100 and 300: 100 + 0.98 * 200.
    assert m.ttft.mean_ms == pytest.approx(150.0)
    assert m.ttft.median_ms == pytest.approx(100.0)
    assert m.ttft.percentile(99) == pytest.approx(296.0)
    # TPOT only for requests with more than one token: [33.33, 100].
    assert m.tpot.mean_ms == pytest.approx((100 / 3 + 100) / 2)
    assert m.tpot.median_ms == pytest.approx((100 / 3 + 100) / 2)
    # ITL pooled over every gap of every request, not averaged per request: [20, 30, 50, 100, 100].
    assert m.itl.mean_ms == pytest.approx(60.0)
    assert m.itl.median_ms == pytest.approx(50.0)
    assert m.itl.percentile(50) == pytest.approx(50.0)
    assert m.itl.percentile(99) == pytest.approx(100.0)
    # E2EL over [200, 250, 300].
    assert m.e2el.mean_ms == pytest.approx(250.0)
    assert m.e2el.percentile(99) == pytest.approx(299.0)
    assert m.e2el.std_ms == pytest.approx((5000 / 3) ** 0.5)


@pytest.mark.parametrize(("slos", "expected"), [
    # r1 meets both; r2 misses TTFT; r3 misses TPOT (100 ms).
    (["ttft:150", "tpot:50"], 0.5),
    (["e2el:260"], 1.0),  # r1 (200) and r3 (250)
    (["tpot:10"], 0.5),  # only the one-token request, whose TPOT counts as 0
    (["ttft:1000", "tpot:1000", "e2el:1000"], 1.5),
    (["ttft:0"], 0.0),
])
def test_goodput_counts_requests_meeting_every_slo(slos: list[str], expected: float) -> None:
    m = compute_metrics(_records(), duration_s=2.0, slos_ms=parse_goodput(slos))
    assert m.request_goodput == pytest.approx(expected)


def test_failed_request_never_meets_slos() -> None:
    assert not meets_slos(RequestRecord(success=False), {"ttft": 1e9})


@pytest.mark.parametrize("bad", ["ttft", "itl:5", "ttft:abc", "ttft:-1", "ttft:inf"])
def test_parse_goodput_rejects_malformed(bad: str) -> None:
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput([bad])


def test_empty_run_reports_zeros_not_errors() -> None:
    m = compute_metrics([RequestRecord(success=False)], duration_s=1.0)
    assert m.completed == 0 and m.ttft.mean_ms == 0.0 and m.itl.percentile(99) == 0.0


def test_format_uses_vllm_field_names() -> None:
    m = compute_metrics(_records(), duration_s=2.0, slos_ms={"ttft": 150.0})
    text = format_metrics(m, max_concurrency=4)
    for label in ("Successful requests:", "Failed requests:", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):", "Request goodput (req/s):",
                  "Output token throughput (tok/s):", "Total Token throughput (tok/s):", "Mean TTFT (ms):",
                  "Median TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):",
                  "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):", "Mean E2EL (ms):", "Median E2EL (ms):",
                  "P99 E2EL (ms):", "Maximum request concurrency:"):
        assert label in text, label
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert "Successful requests:                     3" in text
    assert "Mean TTFT (ms):                          150.00" in text
    assert "---------------Time to First Token----------------" in lines


def test_result_json_keeps_per_request_lists_aligned() -> None:
    records = _records()
    m = compute_metrics(records, duration_s=2.0, percentiles=(99, 99.9))
    result = result_json(m, records)
    assert result["completed"] == 3 and result["failed"] == 1
    assert result["input_lens"] == [10, 20, 5, 7]
    assert result["output_lens"] == [4, 1, 3, 0]
    assert result["ttfts"] == [0.1, 0.3, 0.05, 0.0]
    assert result["itls"] == [[0.02, 0.03, 0.05], [], [0.1, 0.1], []]
    assert result["e2els"] == [0.2, 0.3, 0.25, 0.0]
    assert result["errors"][3] == "HTTP 500"
    assert result["mean_ttft_ms"] == pytest.approx(150.0)
    assert "p99_itl_ms" in result and "p99.9_e2el_ms" in result and "std_tpot_ms" in result
