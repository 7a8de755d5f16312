"""Exports of the tracer's data: one request's timeline and Chrome trace-event JSON.

- `request_timeline`: a request's lifetime tiled by the loop's stages (`Stage`: schedule, kv, execute,
  sample, update, release) and, between them, where the request was in its life (`RequestStatus`: waiting
  before its first step, running between its steps, preempted until it resumes).
- `to_chrome_trace`: Chrome trace-event JSON for Perfetto / chrome://tracing: one track for the engine
  loop with its stage spans, one track per request with its phases (queued, prefill, decode, preempted).

The mechanism-diagram export of one request is `mechanism.py`, built on the timeline. The KV stage's time
(prefix lookups and allocations) interleaves with the scheduler's decisions inside `schedule()`; exports show
it as one span right after the scheduling span, so the two add up to it. Pure functions of copies: they run
outside the tracer's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from tokenloop.observe.records import STAGES, Stage
from tokenloop.observe.traces import ChunkTrace, IterationTrace, RequestTrace
from tokenloop.request import RequestStatus

SegmentKind: TypeAlias = Stage | RequestStatus
"""A piece of a request's life: a stage of a step it took part in, or its status between them."""
WAITING, RUNNING, PREEMPTED = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED
# The Chrome trace's and the dashboard's word for a waiting request's bar.
_PHASE_NAMES: dict[SegmentKind, str] = {WAITING: "queued"}


def iterations_of(trace: RequestTrace, recent: Iterable[IterationTrace]) -> list[IterationTrace]:
    """The request's own iterations plus the recent ones inside its lifetime, in order."""
    by_index = {chunk.iteration.index: chunk.iteration for chunk in trace.chunks}
    end = trace.release.end_ns if trace.release is not None else None
    for it in recent:
        if it.end_ns >= trace.arrival_ns and (end is None or it.start_ns <= end):
            by_index.setdefault(it.index, it)
    return [by_index[i] for i in sorted(by_index)]


# ---- one request's timeline ---------------------------------------------------------------------------

@dataclass(slots=True)
class Segment:
    """A piece of a request's lifetime: [start_ns, end_ns). Consecutive segments tile it exactly."""

    kind: SegmentKind
    start_ns: int
    end_ns: int
    chunk: ChunkTrace | None = None
    last: bool = False  # the request's last iteration

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def request_timeline(trace: RequestTrace) -> list[Segment]:
    """Tile the request's lifetime, arrival to the end of its release, with the loop's stages.

    Within each iteration the request took part in: schedule, kv, execute, sample, update (the last
    iteration's update ends where the release begins). Between them: `running` (back in scheduling) or
    `preempted` (from the step that preempted it to the one that resumed it). Before the first: `waiting`.
    """
    segments: list[Segment] = []
    preemptions = [e.ts_ns for e in trace.events if e.name == "preempted"]
    release = trace.release
    cursor = trace.arrival_ns

    def gap(until: int) -> None:
        nonlocal cursor
        if not segments:
            segments.append(Segment(WAITING, cursor, until))
        else:
            inside = [t for t in preemptions if cursor <= t <= until]
            if inside:
                segments.append(Segment(RUNNING, cursor, inside[0]))
                segments.append(Segment(PREEMPTED, inside[0], until))
            else:
                segments.append(Segment(RUNNING, cursor, until))
        cursor = until

    num_chunks = len(trace.chunks)
    for i, chunk in enumerate(trace.chunks):
        it = chunk.iteration
        gap(it.start_ns)
        last = i == num_chunks - 1
        end = it.end_ns
        if last and release is not None and it.start_ns <= release.start_ns <= it.end_ns:
            end = release.start_ns  # released during this step's update
        kv_start = it.schedule_end_ns - it.kv_ns
        for kind, a, b in ((Stage.SCHEDULE, it.start_ns, kv_start), (Stage.KV, kv_start, it.schedule_end_ns),
                           (Stage.EXECUTE, it.schedule_end_ns, it.execute_end_ns),
                           (Stage.SAMPLE, it.execute_end_ns, it.sample_end_ns),
                           (Stage.UPDATE, it.sample_end_ns, end)):
            segments.append(Segment(kind, a, b, chunk, last))
        cursor = end
    if release is not None:
        if release.start_ns > cursor or not segments:
            gap(release.start_ns)
        segments.append(Segment(Stage.RELEASE, cursor, release.end_ns))
    return segments


# ---- Chrome trace export ----------------------------------------------------------------------------------

_ENGINE_PID = 1
_LOOP_TID = 1


def _us(ns: int, origin: int) -> int:
    # Whole microseconds: nested spans then share exact boundaries (no float rounding across them).
    return (ns - origin) // 1000


def to_chrome_trace(iterations: Sequence[IterationTrace], traces: Sequence[RequestTrace],
                    origin_ns: int) -> dict[str, Any]:
    """Chrome trace-event JSON (complete `X` events, metadata naming the tracks) for Perfetto.

    Track 1 is the engine loop: a `step N` span per iteration with its stage spans nested inside.
    Tracks 2.. are one per request: `queued`, `prefill`, `decode`, `preempted`, `recompute` phases with
    one nested span per iteration the request took part in, its `release`, and instant events for its
    transitions.
    """
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": _ENGINE_PID, "tid": 0, "name": "process_name",
         "args": {"name": "tokenloop engine"}},
        {"ph": "M", "pid": _ENGINE_PID, "tid": _LOOP_TID, "name": "thread_name",
         "args": {"name": "engine loop"}},
        {"ph": "M", "pid": _ENGINE_PID, "tid": _LOOP_TID, "name": "thread_sort_index",
         "args": {"sort_index": 0}},
    ]

    def span(tid: int, name: str, start: int, end: int, cat: str, args: dict[str, Any] | None = None) -> None:
        a, b = _us(start, origin_ns), _us(end, origin_ns)
        event: dict[str, Any] = {"ph": "X", "pid": _ENGINE_PID, "tid": tid, "name": name, "cat": cat,
                                 "ts": a, "dur": max(0, b - a)}
        if args:
            event["args"] = args
        events.append(event)

    for it in iterations:
        stage_ns = it.stage_ns()
        span(_LOOP_TID, f"step {it.index}", it.start_ns, it.end_ns, "iteration", {
            "batch": it.num_scheduled, "tokens": it.num_batched_tokens,
            "prefill_tokens": it.num_prefill_tokens, "sampled": it.num_sampled, "admitted": it.num_admitted,
            "preempted": it.num_preempted,
            "finished": it.num_finished, "blocks_allocated": it.blocks_allocated,
            "blocks_reused": it.blocks_reused, "prefix_hit_tokens": it.prefix_hit_tokens,
            "forward_ms": it.forward_ns / 1e6, "running": it.num_running, "waiting": it.num_waiting,
            "free_blocks": it.num_free_blocks})
        cursor = it.start_ns
        for stage in STAGES:
            duration = stage_ns[stage]
            if stage is Stage.RELEASE and duration == 0:
                continue
            span(_LOOP_TID, stage, cursor, cursor + duration, "stage", {"ms": duration / 1e6})
            cursor += duration

    for number, trace in enumerate(traces):
        tid = _LOOP_TID + 1 + number
        events.append({"ph": "M", "pid": _ENGINE_PID, "tid": tid, "name": "thread_name",
                       "args": {"name": f"request {trace.request_id}"}})
        events.append({"ph": "M", "pid": _ENGINE_PID, "tid": tid, "name": "thread_sort_index",
                       "args": {"sort_index": 1 + number}})
        _request_track(trace, tid, span, events, origin_ns)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "tokenloop", "clock": "engine clock, microseconds since tracer start"}}


def _request_track(trace: RequestTrace, tid: int, span: Callable[..., None], events: list[dict[str, Any]],
                   origin_ns: int) -> None:
    """Phase spans, per-iteration spans nested in them, the release, and instant events."""
    segments = request_timeline(trace)
    chunk_spans: list[tuple[ChunkTrace, int, int]] = []  # each iteration the request took part in
    phases: list[tuple[str, int, int]] = []
    preempted_since_last = False
    for seg in segments:
        if seg.chunk is None:
            if seg.kind in (WAITING, PREEMPTED, Stage.RELEASE):
                phases.append((_PHASE_NAMES.get(seg.kind, seg.kind), seg.start_ns, seg.end_ns))
                preempted_since_last = preempted_since_last or seg.kind is PREEMPTED
            continue
        if chunk_spans and chunk_spans[-1][0] is seg.chunk:
            chunk_spans[-1] = (seg.chunk, chunk_spans[-1][1], seg.end_ns)
            phases[-1] = (phases[-1][0], phases[-1][1], seg.end_ns)
            continue
        chunk_spans.append((seg.chunk, seg.start_ns, seg.end_ns))
        kind = seg.chunk.kind
        # Consecutive iterations of one kind form one phase, gaps between them included.
        if phases and phases[-1][0] == kind and not preempted_since_last:
            phases[-1] = (kind, phases[-1][1], seg.end_ns)
        else:
            phases.append((kind, seg.start_ns, seg.end_ns))
        preempted_since_last = False
    for name, start, end in phases:
        args: dict[str, Any] = {"request_id": trace.request_id}
        if trace.lora_name is not None:
            args["lora_adapter"] = trace.lora_name
        if name == Stage.RELEASE and trace.release is not None:
            r = trace.release
            args |= {"finish_reason": trace.finish_reason, "blocks": len(r.block_ids), "freed": r.num_freed,
                     "kept_cached": r.num_kept_cached, "still_shared": r.num_still_shared}
        span(tid, name, start, end, "phase", args)
    for chunk, start, end in chunk_spans:
        positions = f"{chunk.start}..{chunk.start + chunk.num_tokens - 1}"
        label = (f"decode token {chunk.num_output_tokens}" if chunk.kind == "decode"
                 else f"{chunk.kind} chunk [{positions}]")
        args = {"iteration": chunk.iteration.index, "tokens": chunk.num_tokens, "positions": positions,
                "batch": chunk.iteration.num_scheduled, "blocks_allocated": list(chunk.new_block_ids),
                "blocks_reused": list(chunk.reused_block_ids), "prefix_hit_tokens": chunk.prefix_hit_tokens}
        if chunk.token_id is not None:
            args["token_id"] = chunk.token_id
        span(tid, label, start, end, "chunk", args)
    for event in trace.sorted_events():
        if event.name == "prefill_chunk":
            continue  # drawn as spans
        events.append({"ph": "i", "s": "t", "pid": _ENGINE_PID, "tid": tid, "name": event.name,
                       "ts": _us(event.ts_ns, origin_ns), "cat": "lifecycle", "args": _jsonable(event.args)})


def _jsonable(args: dict[str, Any]) -> dict[str, Any]:
    plain = (int, float, str, bool, list, type(None))
    return {k: (v if isinstance(v, plain) else str(v)) for k, v in args.items()}
