"""Benchmark metrics, defined as `vllm bench serve` defines them, and its report format.

Per request the client records when it sent the request, when each streamed chunk carrying text arrived,
and how many tokens the server says it generated. From those:

- TTFT: first text chunk - request sent.
- ITL: gaps between consecutive text chunks, pooled over all requests (not averaged per request first).
- TPOT: (E2EL - TTFT) / (output_len - 1), only for requests with output_len > 1 (counted as 0 for goodput).
- E2EL: last chunk - request sent.
- Goodput: requests meeting every given SLO (ttft, tpot, e2el, in ms) per second of benchmark duration.

Percentiles interpolate linearly between order statistics (numpy's default), as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
# The section header vLLM prints above each metric's lines.
_SECTION_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


@dataclass
class RequestRecord:
    """What a client observed of one request (times in seconds from when it was sent)."""

    success: bool
    prompt_len: int = 0
    output_len: int = 0
    ttft_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0
    start_s: float = 0.0  # when it was sent, from the benchmark's start
    error: str = ""
    generated_text: str = ""
    request_id: str = ""
    priority: int = 0
    user: str | None = None
    queue_wait_s: float | None = None  # known only in-process (the engine saw it)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for a request with one token or fewer."""
        if self.output_len <= 1:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_len - 1)


@dataclass(frozen=True)
class LatencyStats:
    """Summary of one latency metric, in milliseconds."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[float, float]  # percentile (e.g. 99.0) -> value

    @classmethod
    def of(cls, values_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
        """Stats of `values_s` (seconds); all zeros for an empty list, as vLLM reports them."""
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        if ms.size == 0:
            return cls(0.0, 0.0, 0.0, {float(p): 0.0 for p in percentiles})
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                   {float(p): float(np.percentile(ms, p)) for p in percentiles})

    def percentile(self, p: float) -> float:
        return self.percentiles_ms[float(p)]


@dataclass(frozen=True)
class BenchmarkMetrics:
    """The aggregate numbers `vllm bench serve` prints and saves."""

    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None  # None when no SLO was given
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats

    def stats(self, metric: str) -> LatencyStats:
        return {"ttft": self.ttft, "tpot": self.tpot, "itl": self.itl, "e2el": self.e2el}[metric]


def parse_goodput(items: Iterable[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> `{"ttft": 500.0, "tpot": 50.0}` (milliseconds); ValueError if malformed."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"goodput SLO {item!r} must be NAME:MILLISECONDS with NAME one of "
                             f"{', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms >= 0 or math.isinf(ms):
            raise ValueError(f"goodput SLO {item!r}: the limit must be a finite number >= 0")
        slos[name] = ms
    return slos


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request is within every SLO (a one-token request's TPOT counts as 0)."""
    if not record.success:
        return False
    values_s = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.e2el_s}
    return all(values_s[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, *,
                    slos_ms: dict[str, float] | None = None,
                    percentiles: Sequence[float] = (99.0,)) -> BenchmarkMetrics:
    """Aggregate per-request records over a benchmark that took `duration_s` seconds."""
    done = [r for r in records if r.success]
    duration = duration_s if duration_s > 0 else float("nan")
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_len for r in done)
    tpots = [t for t in (r.tpot_s for r in done) if t is not None]
    itls = [gap for r in done for gap in r.itls_s]
    goodput = None
    if slos_ms:
        goodput = sum(1 for r in done if meets_slos(r, slos_ms)) / duration
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(done) / duration,
        request_goodput=goodput,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        ttft=LatencyStats.of([r.ttft_s for r in done], percentiles),
        tpot=LatencyStats.of(tpots, percentiles),
        itl=LatencyStats.of(itls, percentiles),
        e2el=LatencyStats.of([r.e2el_s for r in done], percentiles),
    )


def _percentile_word(p: float) -> str:
    """99.0 -> '99', 99.9 -> '99.9' (vLLM's key spelling)."""
    return str(int(p)) if int(p) == p else str(p)


def _line(label: str, value: Any, precision: int | None = None) -> str:
    text = f"{value:.{precision}f}" if precision is not None else str(value)
    return f"{label:<40} {text:<10}"


def format_metrics(metrics: BenchmarkMetrics, *, title: str = "Serving Benchmark Result",
                   selected: Sequence[str] = METRIC_NAMES, max_concurrency: int | None = None) -> str:
    """The result block in `vllm bench serve`'s layout and field names."""
    lines = [f"{' ' + title + ' ':=^50}",
             _line("Successful requests:", metrics.completed),
             _line("Failed requests:", metrics.failed)]
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    lines += [_line("Benchmark duration (s):", metrics.duration_s, 2),
              _line("Total input tokens:", metrics.total_input),
              _line("Total generated tokens:", metrics.total_output),
              _line("Request throughput (req/s):", metrics.request_throughput, 2)]
    if metrics.request_goodput is not None:
        lines.append(_line("Request goodput (req/s):", metrics.request_goodput, 2))
    lines += [_line("Output token throughput (tok/s):", metrics.output_throughput, 2),
              _line("Total Token throughput (tok/s):", metrics.total_token_throughput, 2)]
    for name in selected:
        stats = metrics.stats(name)
        label = _LABELS[name]
        lines.append(f"{_SECTION_TITLES[name]:-^50}")
        lines.append(_line(f"Mean {label} (ms):", stats.mean_ms, 2))
        lines.append(_line(f"Median {label} (ms):", stats.median_ms, 2))
        for p, value in stats.percentiles_ms.items():
            lines.append(_line(f"P{_percentile_word(p)} {label} (ms):", value, 2))
    lines.append("=" * 50)
    return "\n".join(lines)


def result_json(metrics: BenchmarkMetrics, records: Sequence[RequestRecord],
                selected: Sequence[str] = METRIC_NAMES) -> dict[str, Any]:
    """The saved result: aggregate fields under vLLM's names plus per-request lists."""
    result: dict[str, Any] = {
        "duration": metrics.duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        # Failed requests keep their place with zeros, so lists line up with the prompts.
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_len if r.success else 0 for r in records],
        "ttfts": [r.ttft_s if r.success else 0.0 for r in records],
        "itls": [list(r.itls_s) if r.success else [] for r in records],
        "e2els": [r.e2el_s if r.success else 0.0 for r in records],
        "start_times": [r.start_s for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
    }
    for name in selected:
        stats = metrics.stats(name)
        result[f"mean_{name}_ms"] = stats.mean_ms
        result[f"median_{name}_ms"] = stats.median_ms
        result[f"std_{name}_ms"] = stats.std_ms
        for p, value in stats.percentiles_ms.items():
            result[f"p{_percentile_word(p)}_{name}_ms"] = value
    return result
