"""Policy comparison: per-run summaries, a side-by-side text table, and a self-contained HTML report.

The HTML report loads nothing: styles are inline and every plot is an inline SVG drawn here (no
scripts, no fonts, no CDN), so it opens the same offline, in a mail attachment, or years later. The
charts themselves are `charts.py`.
"""

from __future__ import annotations

import html
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from tokenloop.bench.charts import PALETTE, Series, bar_chart, cdf, gantt_chart, line_chart
from tokenloop.bench.metrics import meets_slos
from tokenloop.bench.replay import ReplayRecord, ReplayRun

LATENCIES = ("ttft", "queue_wait", "itl", "e2el")
_LATENCY_LABELS = {"ttft": "TTFT", "queue_wait": "queue wait", "itl": "ITL", "e2el": "E2EL"}


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


def _line_charts(runs: Sequence[ReplayRun], colors: dict[str, str]) -> tuple[str, str, str, str]:
    """The TTFT CDF, and the queue length, KV usage and running requests over time, one line per run."""

    def series(values: Callable[[ReplayRun], tuple[list[float], list[float]]],
               only: Callable[[ReplayRun], bool] = lambda run: True) -> list[Series]:
        return [Series(run.label, colors[run.label], *values(run)) for run in runs if only(run)]

    ttft_cdf = line_chart(
        series(lambda run: cdf([1000 * r.ttft_s for r in run.records if r.success and r.ttft_s is not None])),
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
    return ttft_cdf, queue, kv, running


def _breakdown_plots(runs: Sequence[ReplayRun], summaries: Sequence[RunSummary], colors: dict[str, str]) -> str:
    """Mean and P99 TTFT of each priority class and each user, one bar per run."""
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

    return (
        bar_chart([g for g, _ in groups], group_bars("mean"), title="Mean TTFT by group", y_label="mean TTFT (ms)")
        + bar_chart([g for g, _ in groups], group_bars("p99"), title="P99 TTFT by group", y_label="p99 TTFT (ms)"))


def render_html(runs: Sequence[ReplayRun], summaries: Sequence[RunSummary], *,
                title: str = "tokenloop policy comparison", settings: dict[str, Any] | None = None,
                with_goodput: bool = False) -> str:
    """The whole report as one HTML string: settings, table, TTFT CDF, queue and KV over time, Gantts."""
    colors = {run.label: PALETTE[i % len(PALETTE)] for i, run in enumerate(runs)}
    ttft_cdf, queue, kv, running = _line_charts(runs, colors)
    breakdown_plots = _breakdown_plots(runs, summaries, colors)
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
