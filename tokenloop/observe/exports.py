"""Exports of the tracer's data: one request's timeline, Chrome trace-event JSON, mechanism scenarios.

- `request_timeline`: a request's lifetime tiled by the loop's stages (queue, schedule, kv, execute,
  sample, update, wait, preempted, release).
- `to_chrome_trace`: Chrome trace-event JSON for Perfetto / chrome://tracing: one track for the engine
  loop with its stage spans, one track per request with its phases (queued, prefill, decode, preempted).
- `to_mechanism`: one real request as a scenario in the mechanism-diagram schema of the design seeds
  (targets state, schedule, kv, ...), each step's duration the measured time in ms.

The KV stage's time (prefix lookups and allocations) interleaves with the scheduler's decisions inside
`schedule()`; exports show it as one span right after the scheduling span, so the two add up to it.
Pure functions of copies: they run outside the tracer's lock.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenloop.observe.records import STAGES
from tokenloop.observe.traces import ChunkTrace, IterationTrace, RequestTrace

MECHANISM_TARGETS: dict[str, dict[str, str]] = {
    "state": {"id": "mechanism-state", "kind": "node", "label": "Tokenized state"},
    "schedule": {"id": "mechanism-schedule", "kind": "node", "label": "Scheduler"},
    "kv": {"id": "mechanism-kv", "kind": "node", "label": "KV allocation / reuse"},
    "execute": {"id": "mechanism-execute", "kind": "node", "label": "Model executor"},
    "sample": {"id": "mechanism-sample", "kind": "node", "label": "Sample / stream"},
    "update": {"id": "mechanism-update", "kind": "node", "label": "Update state"},
    "release": {"id": "mechanism-release", "kind": "node", "label": "Release references"},
    "admit": {"id": "mechanism-admit", "kind": "edge", "label": "admit"},
    "allocate": {"id": "mechanism-allocate", "kind": "edge", "label": "allocate"},
    "run": {"id": "mechanism-run", "kind": "edge", "label": "run"},
    "sample-output": {"id": "mechanism-sample-output", "kind": "edge", "label": "sample-output"},
    "update-output": {"id": "mechanism-update-output", "kind": "edge", "label": "update-output"},
    "unfinished": {"id": "mechanism-unfinished", "kind": "edge", "label": "unfinished"},
    "finished": {"id": "mechanism-finished", "kind": "edge", "label": "completed"},
}
"""The serving-loop diagram's targets, with the node and edge ids the design seeds use."""

STATE_LABELS = {"stage": "Stage", "artifact": "Artifact"}


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

    kind: str  # queue, schedule, kv, execute, sample, update, wait, preempted, release
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
    iteration's update ends where the release begins). Between them: `wait` (back in scheduling) or
    `preempted` (from the step that preempted it to the one that resumed it). Before the first: `queue`.
    """
    segments: list[Segment] = []
    preemptions = [e.ts_ns for e in trace.events if e.name == "preempted"]
    release = trace.release
    cursor = trace.arrival_ns

    def gap(until: int) -> None:
        nonlocal cursor
        if not segments:
            segments.append(Segment("queue", cursor, until))
        else:
            inside = [t for t in preemptions if cursor <= t <= until]
            if inside:
                segments.append(Segment("wait", cursor, inside[0]))
                segments.append(Segment("preempted", inside[0], until))
            else:
                segments.append(Segment("wait", cursor, until))
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
        for kind, a, b in (("schedule", it.start_ns, kv_start), ("kv", kv_start, it.schedule_end_ns),
                           ("execute", it.schedule_end_ns, it.execute_end_ns),
                           ("sample", it.execute_end_ns, it.sample_end_ns),
                           ("update", it.sample_end_ns, end)):
            segments.append(Segment(kind, a, b, chunk, last))
        cursor = end
    if release is not None:
        if release.start_ns > cursor or not segments:
            gap(release.start_ns)
        segments.append(Segment("release", cursor, release.end_ns))
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
            if stage == "release" and duration == 0:
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
            if seg.kind in ("queue", "preempted", "release"):
                phases.append(({"queue": "queued"}.get(seg.kind, seg.kind), seg.start_ns, seg.end_ns))
                preempted_since_last = preempted_since_last or seg.kind == "preempted"
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
        if name == "release" and trace.release is not None:
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


# ---- mechanism-diagram export ------------------------------------------------------------------------

def _file_sha256(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""


def _ids(ids: Sequence[int], limit: int = 12) -> str:
    shown = ", ".join(str(i) for i in list(ids)[:limit])
    return f"[{shown}{', ...' if len(ids) > limit else ''}]"


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f} ms"


def to_mechanism(trace: RequestTrace, decode: Callable[[Sequence[int]], str] = lambda ids: "",
                 block_size: int | None = None) -> dict[str, Any]:
    """One real request as a mechanism scenario in the design seeds' schema.

    Steps tile the request's lifetime (arrival to the end of its release) in engine order; each step's
    `duration` is its measured time in ms (microsecond resolution, rounded so the durations add up to the
    measured lifetime). The step that samples the last token ends exactly at the request's e2e latency.
    """
    segments = request_timeline(trace)
    steps: list[dict[str, Any]] = []
    # Cumulative rounding: each duration is the difference of rounded running totals, so the sum of all
    # durations is the rounded total, however many steps there are.
    cum_ns = 0
    cum_us_prev = 0
    sampled_before = 0
    for seg in segments:
        cum_ns += seg.duration_ns
        cum_us = round(cum_ns / 1000)
        duration_ms = (cum_us - cum_us_prev) / 1000
        cum_us_prev = cum_us
        title, description, active, paths, artifact = _describe(seg, trace, decode, block_size,
                                                                sampled_before)
        if seg.kind == "sample" and seg.chunk is not None and seg.chunk.token_id is not None:
            sampled_before += 1
        steps.append({"title": title, "description": description, "duration": duration_ms, "active": active,
                      "paths": paths, "state": {"stage": title, "artifact": artifact}})
    e2e = trace.e2e_ns
    lifetime = trace.lifetime_ns
    cached = trace.chunks[0].prefix_hit_tokens if trace.chunks else 0
    out_ids = list(trace.output_token_ids)
    text = decode(out_ids) if out_ids else ""
    queue_ns = segments[0].duration_ns if segments and segments[0].kind == "queue" else 0
    summary = (f"Measured on the engine clock: queue wait {_ms(queue_ns)}"
               + (f", TTFT {_ms(trace.first_token_ns - trace.arrival_ns)}" if trace.first_token_ns else "")
               + (f", e2e (arrival to last token) {_ms(e2e)}" if e2e is not None else "")
               + (f", arrival to release {_ms(lifetime)}" if lifetime is not None else ", still running")
               + f". {trace.num_prompt_tokens} prompt tokens ({cached} from the prefix cache), "
               f"{len(out_ids)} output tokens, {trace.num_preemptions} preemption(s)"
               + (f", finish reason {trace.finish_reason}" if trace.finish_reason else "") + ".")
    here = Path(__file__).resolve()
    slug = "".join(c if c.isalnum() or c in "-_" else "-" for c in trace.request_id)
    return {
        "version": 1,
        "language": "en",
        "title": f"Serving iteration, measured: request {trace.request_id}",
        "description": ("One real request through tokenloop's serving loop: it waits in the queue, is "
                        "admitted with KV blocks allocated or reused from the prefix cache, runs in batches, "
                        "samples one token per step, returns to scheduling while unfinished, and releases "
                        "its block references when it completes. " + summary),
        "caption": (f"Request {trace.request_id}, recorded by tokenloop's tracer. Output: {text!r}. "
                    "Step durations are measured engine time, not illustrative playback time."),
        "alt": ("Serving-loop flow for one measured request: queue, scheduler, KV allocation and reuse, "
                "model executor, sampling and update repeated per generated token, then release of "
                "references."),
        "sources": [
            {"path": "tokenloop/observe/tracer.py", "sha256": _file_sha256(here.parent / "tracer.py"),
             "description": "Tracer that kept the engine's step records and the request's transitions."},
            {"path": "tokenloop/observe/exports.py", "sha256": _file_sha256(here),
             "description": "This export."},
            {"path": "tokenloop/core/engine_core.py",
             "sha256": _file_sha256(here.parent.parent / "core" / "engine_core.py"),
             "description": "The engine loop whose stages were timed and recorded."},
        ],
        "limitations": [
            "Durations are one measured run on one machine; they vary from run to run.",
            "KV lookups and allocations interleave with scheduling decisions inside one call; their summed "
            "time is shown as the KV step after the scheduling step.",
            "Stages are per batch: a request shares each step's schedule, execute, sample and update time "
            "with the other requests in its batch.",
        ],
        "targets": {key: dict(value) for key, value in MECHANISM_TARGETS.items()},
        "stateLabels": dict(STATE_LABELS),
        "scenarios": [{
            "id": f"request-{slug}",
            "title": f"Request {trace.request_id}: {len(out_ids)} tokens, measured",
            "description": summary,
            "initial": {"stage": "Arrived", "artifact": f"{trace.num_prompt_tokens} prompt token ids "
                        f"{_ids(trace.prompt_token_ids)}"},
            "unselected": [],
            "steps": steps,
        }],
    }


def _describe(seg: Segment, trace: RequestTrace, decode: Callable[[Sequence[int]], str],
              block_size: int | None, sampled_before: int) -> tuple[str, str, list[str], list[str], str]:
    """Title, description, active targets, paths and artifact of one step."""
    chunk = seg.chunk
    took = _ms(seg.duration_ns)
    if seg.kind == "queue":
        return ("Wait in the queue",
                f"The request waits in the scheduler's queue until a step admits it ({took}).",
                ["state"], [], f"{trace.num_prompt_tokens} prompt tokens waiting; queue wait {took}")
    if seg.kind == "wait":
        return ("Return to scheduling",
                f"The unfinished request returns to scheduling ({took} until the next step that serves it).",
                ["schedule"], ["unfinished"],
                f"{sampled_before} output tokens so far; the next step becomes schedulable")
    if seg.kind == "preempted":
        return ("Preempted: wait to recompute", "The scheduler preempted the request to free KV blocks for "
                f"others; it waits ({took}) and will recompute its tokens.", ["state", "schedule"], [],
                "blocks released by preemption; tokens computed again on resume")
    if seg.kind == "release":
        r = trace.release
        if r is None:
            return ("Release references", "The engine releases the request's references.", ["release"],
                    ["finished"], "released")
        return ("Release this request's references",
                f"The engine drops the request's {len(r.block_ids)} block references ({took}).",
                ["release"], ["finished"],
                f"{len(r.block_ids)} block references dropped {_ids(r.block_ids)}: {r.num_kept_cached} kept "
                f"cached (reusable), {r.num_freed} freed, {r.num_still_shared} still shared")
    assert chunk is not None
    it = chunk.iteration
    positions = f"positions {chunk.start}..{chunk.start + chunk.num_tokens - 1}"
    tokens = f"{chunk.num_tokens} token{'s' if chunk.num_tokens != 1 else ''}"
    what = {"prefill": f"prefill chunk of {tokens} ({positions})",
            "recompute": f"recompute chunk of {tokens} ({positions})",
            "decode": f"decode at position {chunk.start}"}[chunk.kind]
    first_iteration = chunk is trace.chunks[0]
    if seg.kind == "schedule":
        return ("Select runnable work" if first_iteration else "Schedule the next step",
                f"The scheduler builds step {it.index}: {what} ({took}).",
                ["state", "schedule"] if first_iteration else ["schedule"], ["admit"],
                f"step {it.index}: batch of {it.num_scheduled} requests, {it.num_batched_tokens} tokens; "
                f"this request: {what}")
    if seg.kind == "kv":
        reuse = (f", reused {len(chunk.reused_block_ids)} cached {_ids(chunk.reused_block_ids)} "
                 f"({chunk.prefix_hit_tokens} prefix hit tokens)" if chunk.reused_block_ids else "")
        return ("Prepare KV capacity" if first_iteration else "Prepare the next KV mapping",
                f"The KV cache manager allocates blocks for the step ({took} for the whole batch).",
                ["kv"], ["allocate"],
                f"allocated {len(chunk.new_block_ids)} new blocks {_ids(chunk.new_block_ids)}{reuse}; "
                f"the table holds {chunk.num_blocks} blocks"
                + (f" of {block_size} tokens" if block_size else ""))
    if seg.kind == "execute":
        return ("Execute the selected batch",
                f"The model runs one forward over the step's {it.num_batched_tokens} tokens"
                f" ({took}; forward {_ms(it.forward_ns)}).", ["execute"], ["run"],
                f"logits for {it.num_sampled} sampling rows of a batch of {it.num_scheduled}")
    if seg.kind == "sample":
        if chunk.token_id is None:
            return ("Sample for the batch",
                    f"The batch samples ({took}); this request's chunk ends inside its prompt, so it gets no "
                    "token yet.", ["sample"], [], "no token: prefill continues")
        text = decode([chunk.token_id])
        ordinal = sampled_before + 1
        return ("Sample and stream the first token" if ordinal == 1 else f"Sample and stream token {ordinal}",
                f"The sampler picks token {chunk.token_id} ({took}).", ["sample"], ["sample-output"],
                f"token id {chunk.token_id} {text!r} (output token {ordinal})")
    # update
    if seg.last and trace.finish_reason is not None:
        reason = trace.finish_reason + (f" ({trace.stop_reason!r})" if trace.stop_reason is not None else "")
        return ("Set request status to completed",
                f"The engine appends the token and the completion check ends the request: {reason} ({took}).",
                ["update"], ["update-output"],
                f"finished: {reason}; {chunk.num_output_tokens} output tokens")
    if chunk.token_id is None:
        done = chunk.start + chunk.num_tokens
        return ("Update state", f"The engine records the computed prompt tokens ({took}).", ["update"],
                ["update-output"],
                f"{done} of {trace.num_prompt_tokens + (chunk.num_output_tokens or 0)} tokens computed; "
                "unfinished")
    limit = trace.max_tokens if trace.max_tokens is not None else math.inf
    return ("Add ID and do a completion check",
            f"The engine appends token {chunk.token_id} and checks the stop conditions ({took}).",
            ["update"], ["update-output"],
            f"{chunk.num_output_tokens} of at most {limit} output tokens; the request stays unfinished")
