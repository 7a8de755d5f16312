"""Policy comparison: per-run summaries, a side-by-side text table, and a self-contained HTML report.

The HTML report loads nothing: styles are inline and every plot is an inline SVG drawn here (no
scripts, no fonts, no CDN), so it opens the same offline, in a mail attachment, or years later.
"""

from __future__ import annotations

import html
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from tokenloop.bench.metrics import meets_slos
from tokenloop.bench.replay import ReplayRecord, ReplayRun

LATENCIES = ("ttft", "queue_wait", "itl", "e2el")
_LATENCY_LABELS = {"ttft": "TTFT", "queue_wait": "queue wait", "itl": "ITL", "e2el": "E2EL"}
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
           "#bcbd22", "#7f7f7f", "#aec7e8", "#98df8a")  # 12: a 4-policy x 3-router grid
# A run of 10^5 requests would draw 10^5 Gantt rows and CDF points per run: the report keeps at most these
# (every k-th request by arrival; the CDF at evenly spaced ranks), so a scale study's page stays a few MB.
MAX_GANTT_REQUESTS = 2000
MAX_CDF_POINTS = 2000


@dataclass(frozen=True)
class Stat3:
    """Mean, median and p99 in milliseconds (None where nothing was measured)."""

    mean: float | None
    p50: float | None
    p99: float | None

    @classmethod
    def of(cls, values_s: Sequence[float] | np.ndarray) -> Stat3:
        if len(values_s) == 0:
            return cls(None, None, None)
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        p50, p99 = np.percentile(ms, [50, 99])  # one partition for both
        return cls(float(ms.mean()), float(p50), float(p99))


@dataclass(frozen=True)
class GroupSummary:
    """One group of requests (all, a priority class, a user) in one run."""

    num_requests: int
    completed: int
    failed: int
    request_throughput: float
    output_throughput: float
    request_goodput: float | None
    latencies: dict[str, Stat3]


@dataclass(frozen=True)
class RunSummary:
    """A run's numbers: overall, per priority class, per user, plus engine counters."""

    label: str
    kind: str
    duration_s: float
    overall: GroupSummary
    by_priority: dict[int, GroupSummary]
    by_user: dict[str, GroupSummary]
    num_preemptions: int | None
    prefix_cache_hit_rate: float | None
    num_steps: int
    wall_s: float


def summarize_group(records: Sequence[ReplayRecord], duration_s: float,
                    slos_ms: dict[str, float] | None) -> GroupSummary:
    done = [r for r in records if r.success]
    duration = duration_s if duration_s > 0 else float("nan")
    values: dict[str, list[float] | np.ndarray] = {
        "ttft": [v for r in done if (v := r.ttft_s) is not None],  # each property read once
        "queue_wait": [v for r in done if (v := r.queue_wait_s) is not None],
        # Every token gap of every request (8 M at 100k simulated requests): straight into one array.
        "itl": np.fromiter(itertools.chain.from_iterable(r.itls_s for r in done), dtype=np.float64,
                           count=sum(len(r.itls_s) for r in done)),
        "e2el": [v for r in done if (v := r.e2el_s) is not None],
    }
    goodput = None
    if slos_ms:
        goodput = sum(1 for r in done if meets_slos(r.to_request_record(), slos_ms)) / duration
    return GroupSummary(
        num_requests=len(records), completed=len(done), failed=len(records) - len(done),
        request_throughput=len(done) / duration, output_throughput=sum(r.output_len for r in done) / duration,
        request_goodput=goodput, latencies={name: Stat3.of(v) for name, v in values.items()})


def summarize_run(run: ReplayRun, slos_ms: dict[str, float] | None = None) -> RunSummary:
    duration = run.duration_s
    priorities = sorted({r.priority for r in run.records})
    users = sorted({r.user for r in run.records if r.user is not None})
    return RunSummary(
        label=run.label, kind=run.kind, duration_s=duration,
        overall=summarize_group(run.records, duration, slos_ms),
        by_priority={p: summarize_group([r for r in run.records if r.priority == p], duration, slos_ms)
                     for p in priorities},
        by_user={u: summarize_group([r for r in run.records if r.user == u], duration, slos_ms) for u in users},
        num_preemptions=run.num_preemptions, prefix_cache_hit_rate=run.prefix_cache_hit_rate,
        num_steps=run.num_steps, wall_s=run.wall_s)


# ---- the table -----------------------------------------------------------------------------------

Row = tuple[str, list[str]]  # label, one cell per run; a row whose cells are empty is a section header


def _fmt(value: float | int | None, precision: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{precision}f}"


def _group_rows(groups: Sequence[GroupSummary], with_goodput: bool, brief: bool) -> list[Row]:
    rows: list[Row] = []
    if not brief:
        rows.append(("Successful requests", [_fmt(g.completed) for g in groups]))
        rows.append(("Failed requests", [_fmt(g.failed) for g in groups]))
    rows.append(("Request throughput (req/s)", [_fmt(g.request_throughput, 3) for g in groups]))
    rows.append(("Output token throughput (tok/s)", [_fmt(g.output_throughput) for g in groups]))
    if with_goodput:
        rows.append(("Request goodput (req/s)", [_fmt(g.request_goodput, 3) for g in groups]))
    for name in LATENCIES:
        label = _LATENCY_LABELS[name]
        for stat, title in (("mean", "Mean"), ("p50", "P50"), ("p99", "P99")):
            rows.append((f"{title} {label} (ms)", [_fmt(getattr(g.latencies[name], stat)) for g in groups]))
    return rows


def overall_rows(summaries: Sequence[RunSummary], with_goodput: bool = False) -> list[Row]:
    """The rows over all requests, plus the engine's counters."""
    rows: list[Row] = [("Benchmark duration (s)", [_fmt(s.duration_s) for s in summaries])]
    rows += _group_rows([s.overall for s in summaries], with_goodput, brief=False)
    rows.append(("Preemptions", [_fmt(s.num_preemptions) for s in summaries]))
    rows.append(("Prefix cache hit rate (%)",
                 [_fmt(None if s.prefix_cache_hit_rate is None else 100 * s.prefix_cache_hit_rate)
                  for s in summaries]))
    rows.append(("Engine steps", [_fmt(s.num_steps) for s in summaries]))
    rows.append(("Replay wall time (s)", [_fmt(s.wall_s) for s in summaries]))
    return rows


def breakdown_rows(summaries: Sequence[RunSummary], with_goodput: bool = False) -> list[Row]:
    """The rows per priority class, then per user (each group under a header row)."""
    rows: list[Row] = []
    first = summaries[0]
    for priority, group in first.by_priority.items():
        rows.append((f"priority {priority} ({group.num_requests} requests)", []))
        rows += _group_rows([s.by_priority[priority] for s in summaries], with_goodput, brief=True)
    for user, group in first.by_user.items():
        rows.append((f"user {user} ({group.num_requests} requests)", []))
        rows += _group_rows([s.by_user[user] for s in summaries], with_goodput, brief=True)
    return rows


def table_rows(summaries: Sequence[RunSummary], with_goodput: bool = False) -> list[Row]:
    """Every row of the comparison, overall first, then per priority class and per user."""
    return overall_rows(summaries, with_goodput) + breakdown_rows(summaries, with_goodput)


def format_table(summaries: Sequence[RunSummary], with_goodput: bool = False,
                 title: str = "Policy comparison") -> str:
    """The side-by-side text table, one column per run."""
    return format_rows(title, [s.label for s in summaries], table_rows(summaries, with_goodput))


def format_rows(title: str, columns: Sequence[str], rows: Sequence[Row]) -> str:
    """Rows of cells under one header per column, in the comparison table's layout."""
    label_width = max(40, max(len(label) for label, _ in rows) + 2)
    col = max(12, max(len(c) for c in columns) + 2)
    width = label_width + col * len(columns)
    lines = [f"{' ' + title + ' ':=^{width}}",
             f"{'':<{label_width}}" + "".join(f"{c:>{col}}" for c in columns)]
    for label, cells in rows:
        if not cells:
            lines.append(f"{' ' + label + ' ':-^{width}}")
        else:
            lines.append(f"{label:<{label_width}}" + "".join(f"{c:>{col}}" for c in cells))
    lines.append("=" * width)
    return "\n".join(lines)


# ---- SVG plots -----------------------------------------------------------------------------------

@dataclass
class Series:
    """One line of a chart."""

    label: str
    color: str
    xs: list[float]
    ys: list[float]


@dataclass
class _Frame:
    """A plot area and the mapping from data to pixels."""

    width: int
    height: int
    x_range: tuple[float, float]
    y_range: tuple[float, float]
    left: int = 64
    right: int = 16
    top: int = 28
    bottom: int = 44
    parts: list[str] = field(default_factory=list)

    def x(self, value: float) -> float:
        lo, hi = self.x_range
        return self.left + (value - lo) / (hi - lo or 1.0) * (self.width - self.left - self.right)

    def y(self, value: float) -> float:
        lo, hi = self.y_range
        return self.height - self.bottom - (value - lo) / (hi - lo or 1.0) * (self.height - self.top - self.bottom)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, count)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    ticks = []
    value = first
    while value <= hi + step * 1e-9:
        ticks.append(round(value, 10))
        value += step
    return ticks


def _tick_label(value: float) -> str:
    if abs(value) >= 1e6:
        return f"{value / 1e6:g}M"
    return f"{value / 1e3:g}k" if abs(value) >= 1e4 else f"{value:g}"


def _axes(frame: _Frame, x_label: str, y_label: str) -> None:
    p = frame.parts
    x0, x1 = frame.left, frame.width - frame.right
    y0, y1 = frame.height - frame.bottom, frame.top
    p.append(f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" fill="#fff" stroke="#999"/>')
    for tick in nice_ticks(*frame.x_range, count=8):
        x = frame.x(tick)
        p.append(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y0 + 4}" stroke="#999"/>'
                 f'<text x="{x:.1f}" y="{y0 + 16}" text-anchor="middle">{_tick_label(tick)}</text>')
    for tick in nice_ticks(*frame.y_range):
        y = frame.y(tick)
        p.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x1}" y2="{y:.1f}" stroke="#eee"/>'
                 f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{_tick_label(tick)}</text>')
    p.append(f'<text x="{(x0 + x1) / 2:.0f}" y="{frame.height - 8}" text-anchor="middle">{html.escape(x_label)}</text>')
    p.append(f'<text x="14" y="{(y0 + y1) / 2:.0f}" text-anchor="middle" '
             f'transform="rotate(-90 14 {(y0 + y1) / 2:.0f})">{html.escape(y_label)}</text>')


def _legend(frame: _Frame, items: Sequence[tuple[str, str]]) -> None:
    x = frame.left
    for label, color in items:
        frame.parts.append(f'<rect x="{x}" y="8" width="12" height="10" fill="{color}"/>'
                           f'<text x="{x + 16}" y="17">{html.escape(label)}</text>')
        x += 28 + 7 * len(label)


def _svg(frame: _Frame, title: str) -> str:
    frame.parts.append(f'<text x="{frame.width - frame.right}" y="17" text-anchor="end" font-weight="bold">'
                       f'{html.escape(title)}</text>')
    body = "".join(frame.parts)
    return (f'<svg class="plot" width="{frame.width}" height="{frame.height}" viewBox="0 0 {frame.width} '
            f'{frame.height}" role="img" font-family="sans-serif" font-size="11">'
            f'<title>{html.escape(title)}</title>{body}</svg>')


def line_chart(series: Sequence[Series], *, title: str, x_label: str, y_label: str, step: bool = False,
               width: int = 900, height: int = 320, y_min: float | None = 0.0) -> str:
    """Lines (or step lines) of several series on shared axes, as an SVG element."""
    xs = [x for s in series for x in s.xs]
    ys = [y for s in series for y in s.ys]
    if not xs:
        return f'<p class="empty">{html.escape(title)}: no data.</p>'
    y_lo = min(ys) if y_min is None else min(y_min, min(ys))
    y_hi = max(ys) if max(ys) > y_lo else y_lo + 1.0
    frame = _Frame(width, height, (min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1.0), (y_lo, y_hi * 1.05))
    _axes(frame, x_label, y_label)
    for s in series:
        if not s.xs:
            continue
        points: list[tuple[float, float]] = []
        for i, (x, y) in enumerate(zip(s.xs, s.ys)):
            if step and i:
                points.append((x, s.ys[i - 1]))
            points.append((x, y))
        path = " ".join(f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in points)
        frame.parts.append(f'<polyline fill="none" stroke="{s.color}" stroke-width="1.5" points="{path}"/>')
    _legend(frame, [(s.label, s.color) for s in series])
    return _svg(frame, title)


GANTT_COLORS = {"queue": "#bbbbbb", "prefill": "#ff9f40", "decode": "#3a7bd5", "wait": "#f4c27a"}


def gantt_chart(run: ReplayRun, *, width: int = 900, max_height: int = 1400,
                x_range: tuple[float, float] | None = None) -> str:
    """One row per request (by arrival): queued (arrival to admission), prefill (admission to first
    token), decode (first to last token). A server run cannot tell queue from prefill: one 'wait' bar."""
    records = sorted((r for r in run.records if r.first_token_s is not None), key=lambda r: (r.arrival_s, r.id))
    if not records:
        return f'<p class="empty">{html.escape(run.label)}: no request produced a token.</p>'
    every = -(-len(records) // MAX_GANTT_REQUESTS)
    records = records[::every]
    row = max(1.0, min(10.0, (max_height - 72) / len(records)))
    height = int(row * len(records)) + 72
    end = max(r.last_token_s or r.first_token_s or 0.0 for r in records)
    frame = _Frame(width, height, x_range or (min(r.arrival_s for r in records), end), (0, len(records)))
    _axes(frame, "time (s)", "requests (by arrival)")
    for i, r in enumerate(records):
        y = frame.y(i + 1)
        segments = ([("queue", r.arrival_s, r.first_scheduled_s), ("prefill", r.first_scheduled_s, r.first_token_s)]
                    if r.first_scheduled_s is not None else [("wait", r.arrival_s, r.first_token_s)])
        segments.append(("decode", r.first_token_s, r.last_token_s))
        for kind, start, stop in segments:
            if start is None or stop is None:
                continue
            x0, x1 = frame.x(start), frame.x(stop)
            frame.parts.append(f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0, 0.5):.1f}" '
                               f'height="{max(row - 0.3, 0.7):.1f}" fill="{GANTT_COLORS[kind]}">'
                               f'<title>{html.escape(r.id)} {kind}: {start:.3f}-{stop:.3f} s</title></rect>')
    kinds = ["queue", "prefill", "decode"] if run.kind != "server" else ["wait", "decode"]
    _legend(frame, [(k, GANTT_COLORS[k]) for k in kinds])
    return _svg(frame, f"{run.label}: per-request Gantt")


def bar_chart(groups: Sequence[str], series: Sequence[Series], *, title: str, y_label: str,
              width: int = 900, height: int = 300) -> str:
    """Grouped bars: one group per category, one bar per series (`Series.ys` aligned with `groups`)."""
    values = [y for s in series for y in s.ys if y is not None and math.isfinite(y)]
    if not groups or not values:
        return f'<p class="empty">{html.escape(title)}: no data.</p>'
    frame = _Frame(width, height, (0.0, float(len(groups))), (0.0, max(values) * 1.1 or 1.0), bottom=56)
    p = frame.parts
    x0, x1 = frame.left, frame.width - frame.right
    y0, y1 = frame.height - frame.bottom, frame.top
    p.append(f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" fill="#fff" stroke="#999"/>')
    for tick in nice_ticks(*frame.y_range):
        y = frame.y(tick)
        p.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x1}" y2="{y:.1f}" stroke="#eee"/>'
                 f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{_tick_label(tick)}</text>')
    slot = (frame.x(1) - frame.x(0)) * 0.8 / max(1, len(series))
    for g, group in enumerate(groups):
        base = frame.x(g) + (frame.x(1) - frame.x(0)) * 0.1
        for k, s in enumerate(series):
            value = s.ys[g]
            if value is None or not math.isfinite(value):
                continue
            top = frame.y(value)
            p.append(f'<rect x="{base + k * slot:.1f}" y="{top:.1f}" width="{max(slot - 1, 1):.1f}" '
                     f'height="{y0 - top:.1f}" fill="{s.color}"><title>{html.escape(s.label)} '
                     f'{html.escape(group)}: {value:.2f}</title></rect>')
        p.append(f'<text x="{frame.x(g + 0.5):.1f}" y="{y0 + 16}" text-anchor="middle">{html.escape(group)}</text>')
    p.append(f'<text x="14" y="{(y0 + y1) / 2:.0f}" text-anchor="middle" '
             f'transform="rotate(-90 14 {(y0 + y1) / 2:.0f})">{html.escape(y_label)}</text>')
    _legend(frame, [(s.label, s.color) for s in series])
    return _svg(frame, title)


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    n = len(ordered)
    ranks = range(n) if n <= MAX_CDF_POINTS else sorted({round(k * (n - 1) / (MAX_CDF_POINTS - 1))
                                                         for k in range(MAX_CDF_POINTS)})
    return [ordered[i] for i in ranks], [(i + 1) / n for i in ranks]


def _energy_section(runs: Sequence[ReplayRun], colors: dict[str, str]) -> str:
    """Energy per request (a simulated run with a powered profile keeps it in settings), or ''."""
    summaries = [run.settings.get("energy_per_request") or {} for run in runs]
    if not any(summaries):
        return ""
    stats = (("mean_j", "mean"), ("p50_j", "p50"), ("p90_j", "p90"))
    bars = bar_chart([label for _, label in stats],
                     [Series(run.label, colors[run.label], [0, 1, 2], [s.get(key, float("nan")) for key, _ in stats])
                      for run, s in zip(runs, summaries)],
                     title="Energy per request", y_label="J per request")
    rows = [("all requests (kJ)", [_fmt(s.get("total_j") and s["total_j"] / 1e3) for s in summaries]),
            ("per output token (J)", [_fmt(s.get("j_per_output_token"), 3) for s in summaries]),
            *[(f"per request: {label} (J)", [_fmt(s.get(key)) for s in summaries]) for key, label in stats],
            ("per request: max (J)", [_fmt(s.get("max_j")) for s in summaries])]
    table = _html_table([run.label for run in runs], rows)
    return bars + table + ('<p class="note">Busy power x modelled step time; each step\'s energy is shared by '
                           'its requests in proportion to their tokens in it.</p>')


def _cluster_section(runs: Sequence[ReplayRun], colors: dict[str, str]) -> str:
    """Replicas behind a router (a simulated cluster run keeps them in settings), or ''."""
    clustered = [run for run in runs if run.settings.get("per_replica")]
    if not clustered:
        return ""

    def ttft_ms(run: ReplayRun, q: float) -> float:
        values = [r.ttft_s for r in run.records if r.success and r.ttft_s is not None]
        return float(np.percentile(values, q)) * 1e3 if values else float("nan")

    labels = [run.label for run in clustered]
    ttft = bar_chart(["P50 TTFT", "P90 TTFT"],
                     [Series(run.label, colors[run.label], [0, 1], [ttft_ms(run, 50), ttft_ms(run, 90)])
                      for run in clustered], title="TTFT by run", y_label="TTFT (ms)")
    hits = bar_chart(labels, [Series("prefix hit rate", PALETTE[0], list(range(len(clustered))),
                                     [100 * (run.prefix_cache_hit_rate or 0.0) for run in clustered])],
                     title="Prefix cache hit rate", y_label="hit rate (%)")
    num_replicas = max(len(run.settings["per_replica"]) for run in clustered)
    spread = bar_chart([f"replica {i}" for i in range(num_replicas)],
                       [Series(run.label, colors[run.label], list(range(num_replicas)),
                               [p["requests"] for p in run.settings["per_replica"]]) for run in clustered],
                       title="Requests per replica", y_label="requests")
    return ttft + hits + spread + ('<p class="note">The queue and KV plots above are per engine: a cluster run '
                                   'records per replica, shown here.</p>')

# ---- the HTML page -------------------------------------------------------------------------------

_STYLE = """
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 1100px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 13px; }
td, th { padding: 3px 10px; text-align: right; border-bottom: 1px solid #eee; }
td:first-child, th:first-child { text-align: left; }
tr.section td { background: #f3f3f3; font-weight: bold; text-align: left; }
.note { color: #666; font-size: 13px; } .plot { display: block; margin: 8px 0 20px; }
"""


def _html_table(columns: Sequence[str], rows: Sequence[Row]) -> str:
    head = "<tr><th></th>" + "".join(f"<th>{html.escape(label)}</th>" for label in columns) + "</tr>"
    body = []
    for label, cells in rows:
        if not cells:
            body.append(f'<tr class="section"><td colspan="{len(columns) + 1}">{html.escape(label)}</td></tr>')
        else:
            body.append(f"<tr><td>{html.escape(label)}</td>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table>{head}{''.join(body)}</table>"


def render_html(runs: Sequence[ReplayRun], summaries: Sequence[RunSummary], *,
                title: str = "tokenloop policy comparison", settings: dict[str, Any] | None = None,
                with_goodput: bool = False) -> str:
    """The whole report as one HTML string: settings, table, TTFT CDF, queue and KV over time, Gantts."""
    colors = {run.label: PALETTE[i % len(PALETTE)] for i, run in enumerate(runs)}

    def series(values: Callable[[ReplayRun], tuple[list[float], list[float]]],
               only: Callable[[ReplayRun], bool] = lambda run: True) -> list[Series]:
        return [Series(run.label, colors[run.label], *values(run)) for run in runs if only(run)]

    ttft_cdf = line_chart(
        series(lambda run: _cdf([1000 * r.ttft_s for r in run.records if r.success and r.ttft_s is not None])),
        title="TTFT CDF", x_label="TTFT (ms)", y_label="fraction of requests", step=True)
    has_timeline = lambda run: bool(run.timeline)  # noqa: E731 - a predicate used twice
    queue = line_chart(series(lambda run: ([p.t_s for p in run.timeline], [p.num_waiting for p in run.timeline]),
                              has_timeline),
                       title="Queue length", x_label="time (s)", y_label="waiting requests", step=True)
    kv = line_chart(series(lambda run: ([p.t_s for p in run.timeline], [100 * p.kv_usage for p in run.timeline]),
                           lambda run: bool(run.timeline) and run.kind == "engine"),
                    title="KV cache usage", x_label="time (s)", y_label="KV blocks in use (%)", step=True)
    running = line_chart(series(lambda run: ([p.t_s for p in run.timeline], [p.num_running for p in run.timeline]),
                                has_timeline),
                         title="Running requests", x_label="time (s)", y_label="running requests", step=True)
    groups = [(f"priority {p}", lambda s, p=p: s.by_priority.get(p)) for p in summaries[0].by_priority] + \
        [(f"{u}", lambda s, u=u: s.by_user.get(u)) for u in summaries[0].by_user]

    def group_bars(stat: str) -> list[Series]:
        out = []
        for run, summary in zip(runs, summaries):
            ys = []
            for _, pick in groups:
                group = pick(summary)
                value = getattr(group.latencies["ttft"], stat) if group is not None else None
                ys.append(value if value is not None else float("nan"))
            out.append(Series(run.label, colors[run.label], list(range(len(groups))), ys))
        return out

    breakdown_plots = (
        bar_chart([g for g, _ in groups], group_bars("mean"), title="Mean TTFT by group", y_label="mean TTFT (ms)")
        + bar_chart([g for g, _ in groups], group_bars("p99"), title="P99 TTFT by group", y_label="p99 TTFT (ms)"))
    # One time axis for every Gantt, so runs compare by eye.
    ends = [r.last_token_s for run in runs for r in run.records if r.last_token_s is not None]
    starts = [r.arrival_s for run in runs for r in run.records]
    span = (min(starts), max(ends)) if ends and starts else None
    gantts = "".join(f"<h3>{html.escape(run.label)}</h3>{gantt_chart(run, x_range=span)}" for run in runs)
    settings_html = ""
    if settings:
        items = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(json.dumps(v))}</td></tr>"
                        for k, v in settings.items())
        settings_html = f"<table>{items}</table>"
    sections = [
        ("summary", "Summary", _html_table([s.label for s in summaries], overall_rows(summaries, with_goodput))),
        ("ttft-cdf", "TTFT CDF per run", ttft_cdf),
        ("queue", "Queue length over time",
         queue + '<p class="note">Requests waiting for admission after each step.</p>'),
        ("kv", "KV cache usage over time", kv + running),
        ("gantt", "Per-request Gantt: queue / prefill / decode", gantts),
        ("breakdown", "By priority class and by user",
         breakdown_plots + _html_table([s.label for s in summaries], breakdown_rows(summaries, with_goodput))
         + '<p class="note">A group\'s throughputs are its completions over the whole run.</p>'),
        ("energy", "Energy per request", _energy_section(runs, colors)),
        ("cluster", "Routers and replicas", _cluster_section(runs, colors)),
    ]
    sections = [section for section in sections if section[2]]  # a run without energy or replicas: no section
    body = "".join(f'<section id="{sid}"><h2>{html.escape(heading)}</h2>{content}</section>'
                   for sid, heading, content in sections)
    generated = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f'<p class="note">Generated {generated}. The same trace under each run; everything else fixed.</p>'
            f"{settings_html}{body}</body></html>")


def write_html(path: str | Path, runs: Sequence[ReplayRun], summaries: Sequence[RunSummary], **kwargs: Any) -> Path:
    path = Path(path)
    path.write_text(render_html(runs, summaries, **kwargs), encoding="utf-8")
    return path
