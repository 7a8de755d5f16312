"""The report's SVG charts, drawn by hand (no plotting library): line charts, bar charts and the per-request
Gantt of a replay, each a self-contained `<svg>` string the HTML page embeds."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenloop.bench.replay import ReplayRun

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
           "#bcbd22", "#7f7f7f", "#aec7e8", "#98df8a")  # 12: a 4-policy x 3-router grid
# A run of 10^5 requests would draw 10^5 Gantt rows and CDF points per run: the report keeps at most these
# (every k-th request by arrival; the CDF at evenly spaced ranks), so a scale study's page stays a few MB.
MAX_GANTT_REQUESTS = 2000
MAX_CDF_POINTS = 2000



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


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """The empirical CDF of `values` (at most MAX_CDF_POINTS points, at evenly spaced ranks)."""
    ordered = sorted(values)
    n = len(ordered)
    ranks = range(n) if n <= MAX_CDF_POINTS else sorted({round(k * (n - 1) / (MAX_CDF_POINTS - 1))
                                                         for k in range(MAX_CDF_POINTS)})
    return [ordered[i] for i in ranks], [(i + 1) / n for i in ranks]
