"""The live dashboard's JSON state, built from a copy of the tracer's data (never from the engine).

`Tracer.dashboard_state` copies what it needs into a `Snapshot` under its lock; `build_state` turns it
into the JSON the page polls (tokenloop/serving/static/dashboard.js) outside the lock.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tokenloop.observe.live import LiveRequest
from tokenloop.observe.records import STAGES, StepGauges
from tokenloop.observe.traces import IterationTrace, RequestSummary, RequestTrace


@dataclass
class Snapshot:
    """The tracer's data at one instant (copies: the observer thread goes on writing its own)."""

    now_ns: int
    origin_ns: int
    enabled: bool
    sample_rate: float
    iterations: list[IterationTrace]
    summaries: list[RequestSummary]
    live: list[LiveRequest]
    gauges: StepGauges | None
    ttfts: list[tuple[int, int]]
    throughput: list[list[int]]
    totals: dict[str, int]
    preempted_spans: dict[str, list[tuple[int, int]]]
    num_steps: int
    replicas: dict[int, StepGauges] = field(default_factory=dict)  # per engine replica, for a cluster


def sum_gauges(parts: list[StepGauges]) -> StepGauges | None:
    """Several replicas' gauges as one pool of the cluster (counts and counters add up)."""
    if not parts:
        return None
    if len(parts) == 1:
        return dataclasses.replace(parts[0])
    names = [f.name for f in dataclasses.fields(StepGauges)]
    total = {name: sum(getattr(g, name) for g in parts) for name in names}
    total["block_size"] = parts[0].block_size
    return StepGauges(**total)


def preempted_spans(trace: RequestTrace) -> list[tuple[int, int]]:
    """(preempted at, resumed at) pairs; an open one ends at its release or stays open (end = start)."""
    spans: list[tuple[int, int]] = []
    start: int | None = None
    for event in trace.sorted_events():
        if event.name == "preempted":
            start = event.ts_ns
        elif event.name in ("resumed", "released") and start is not None:
            spans.append((start, event.ts_ns))
            start = None
    if start is not None:
        spans.append((start, start))
    return spans


def _counters(gauges: StepGauges | None, live: list[LiveRequest]) -> dict[str, int]:
    if gauges is None:  # no step yet: only arrivals are known
        return {"waiting": len(live), "running": 0, "preempted": 0}
    preempted = gauges.num_preempted_waiting
    return {"waiting": gauges.num_waiting - preempted, "running": gauges.num_running, "preempted": preempted}


def _blocks(gauges: StepGauges | None) -> dict[str, Any]:
    if gauges is None:
        return {}
    total, cached_free = gauges.num_blocks, gauges.num_cached_free_blocks
    queries = gauges.prefix_cache_queries
    return {"num_blocks": total, "block_size": gauges.block_size,
            "referenced": total - gauges.num_free_blocks, "cached_free": cached_free,
            "free": gauges.num_free_blocks - cached_free,
            "prefix_cache_hit_rate": gauges.prefix_cache_hits / queries if queries else 0.0,
            "evictions": gauges.evictions}


def build_state(s: Snapshot) -> dict[str, Any]:
    """Counters, KV blocks, recent steps, requests (finished and live) and the TTFT / throughput series."""
    origin = s.origin_ns

    def ms(ns: int | None) -> float | None:
        return None if ns is None else round((ns - origin) / 1e6, 3)

    def spans(request_id: str) -> list[list[float | None]]:
        return [[ms(a), ms(b)] for a, b in s.preempted_spans.get(request_id, [])]

    requests = [{
        "id": r.request_id, "state": "finished", "finish_reason": r.finish_reason,
        "arrival_ms": ms(r.arrival_ns), "admitted_ms": ms(r.first_scheduled_ns),
        "first_token_ms": ms(r.first_token_ns), "last_token_ms": ms(r.last_token_ns), "end_ms": ms(r.end_ns),
        "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
        "cached_tokens": r.num_cached_tokens, "preemptions": r.num_preemptions,
        "preempted": spans(r.request_id)} for r in s.summaries]
    requests += [{
        "id": r.request_id, "state": r.state, "finish_reason": None, "arrival_ms": ms(r.arrival_ns),
        "admitted_ms": ms(r.first_scheduled_ns), "first_token_ms": ms(r.first_token_ns),
        "last_token_ms": ms(r.last_token_ns), "end_ms": None, "prompt_tokens": r.num_prompt_tokens,
        "output_tokens": r.num_output_tokens, "cached_tokens": r.num_cached_tokens,
        "preemptions": r.num_preemptions, "preempted": spans(r.request_id)} for r in s.live]
    requests.sort(key=lambda q: q["arrival_ms"] or 0.0)
    return {
        "now_ms": ms(s.now_ns),
        "stages": list(STAGES),  # the loop's stages in order: the page draws these, it keeps no copy
        "tracing": {"enabled": s.enabled, "sample_rate": s.sample_rate},
        "counters": {**_counters(s.gauges, s.live), "steps": s.num_steps, **s.totals},
        "kv": _blocks(s.gauges),
        "replicas": [{"index": i, **_counters(g, []), **_blocks(g)} for i, g in s.replicas.items()]
        if len(s.replicas) > 1 else [],
        "iterations": [{
            "index": it.index, "start_ms": ms(it.start_ns), "end_ms": ms(it.end_ns),
            "stages_ms": {k: round(v / 1e6, 4) for k, v in it.stage_ns().items()},
            "forward_ms": round(it.forward_ns / 1e6, 4), "batch": it.num_scheduled,
            "tokens": it.num_batched_tokens, "prefill_tokens": it.num_prefill_tokens,
            "sampled": it.num_sampled,
            "admitted": it.num_admitted, "preempted": it.num_preempted, "finished": it.num_finished,
            "blocks_allocated": it.blocks_allocated, "blocks_reused": it.blocks_reused,
            "prefix_hit_tokens": it.prefix_hit_tokens, "running": it.num_running, "waiting": it.num_waiting,
            "free_blocks": it.num_free_blocks} for it in s.iterations],
        "requests": requests,
        "ttft": [[ms(t), round(v / 1e6, 3)] for t, v in s.ttfts],
        "throughput": [{"t_s": b[0], "output_tokens": b[1], "batched_tokens": b[2], "steps": b[3]}
                       for b in s.throughput],
    }
