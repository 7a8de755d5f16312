"""The mechanism-diagram export: one real request as a scenario in the design seeds' schema.

Its steps are the request's timeline (`exports.request_timeline`): the targets of the serving-loop diagram
(state, schedule, kv, ...) each step lights, and each step's duration the measured time in ms.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeAlias

from tokenloop.observe.exports import Segment, request_timeline
from tokenloop.observe.records import Stage
from tokenloop.observe.traces import ChunkTrace, RequestTrace
from tokenloop.request import RequestStatus

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
    steps = _scenario_steps(segments, trace, decode, block_size)
    out_ids = list(trace.output_token_ids)
    text = decode(out_ids) if out_ids else ""
    summary = _summary(trace, segments)
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
            {"path": "tokenloop/observe/exports.py", "sha256": _file_sha256(here.parent / "exports.py"),
             "description": "The request's timeline this export steps through."},
            {"path": "tokenloop/observe/mechanism.py", "sha256": _file_sha256(here),
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


def _scenario_steps(segments: list[Segment], trace: RequestTrace, decode: Callable[[Sequence[int]], str],
                    block_size: int | None) -> list[dict[str, Any]]:
    """One scenario step per segment, its duration in ms."""
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
        if seg.kind is Stage.SAMPLE and seg.chunk is not None and seg.chunk.token_id is not None:
            sampled_before += 1
        steps.append({"title": title, "description": description, "duration": duration_ms, "active": active,
                      "paths": paths, "state": {"stage": title, "artifact": artifact}})
    return steps


def _summary(trace: RequestTrace, segments: list[Segment]) -> str:
    """The request's measured latencies and counts, in a sentence."""
    e2e = trace.e2e_ns
    lifetime = trace.lifetime_ns
    cached = trace.chunks[0].prefix_hit_tokens if trace.chunks else 0
    queue_ns = segments[0].duration_ns if segments and segments[0].kind is RequestStatus.WAITING else 0
    return (f"Measured on the engine clock: queue wait {_ms(queue_ns)}"
            + (f", TTFT {_ms(trace.first_token_ns - trace.arrival_ns)}" if trace.first_token_ns else "")
            + (f", e2e (arrival to last token) {_ms(e2e)}" if e2e is not None else "")
            + (f", arrival to release {_ms(lifetime)}" if lifetime is not None else ", still running")
            + f". {trace.num_prompt_tokens} prompt tokens ({cached} from the prefix cache), "
            f"{len(trace.output_token_ids)} output tokens, {trace.num_preemptions} preemption(s)"
            + (f", finish reason {trace.finish_reason}" if trace.finish_reason else "") + ".")


Described: TypeAlias = tuple[str, str, list[str], list[str], str]
"""A scenario step's title, description, active targets, paths and artifact."""


def _describe(seg: Segment, trace: RequestTrace, decode: Callable[[Sequence[int]], str],
              block_size: int | None, sampled_before: int) -> Described:
    """Title, description, active targets, paths and artifact of one step."""
    if seg.chunk is None:
        return _describe_between_steps(seg, trace, sampled_before)
    if seg.kind is Stage.SAMPLE:
        return _describe_sample(seg, seg.chunk, decode, sampled_before)
    if seg.kind is Stage.UPDATE:
        return _describe_update(seg, seg.chunk, trace)
    return _describe_batch_stage(seg, seg.chunk, trace, block_size)


def _describe_between_steps(seg: Segment, trace: RequestTrace, sampled_before: int) -> Described:
    """The request outside a step: waiting, back in scheduling, preempted, or released."""
    took = _ms(seg.duration_ns)
    if seg.kind is RequestStatus.WAITING:
        return ("Wait in the queue",
                f"The request waits in the scheduler's queue until a step admits it ({took}).",
                ["state"], [], f"{trace.num_prompt_tokens} prompt tokens waiting; queue wait {took}")
    if seg.kind is RequestStatus.RUNNING:
        return ("Return to scheduling",
                f"The unfinished request returns to scheduling ({took} until the next step that serves it).",
                ["schedule"], ["unfinished"],
                f"{sampled_before} output tokens so far; the next step becomes schedulable")
    if seg.kind is RequestStatus.PREEMPTED:
        return ("Preempted: wait to recompute", "The scheduler preempted the request to free KV blocks for "
                f"others; it waits ({took}) and will recompute its tokens.", ["state", "schedule"], [],
                "blocks released by preemption; tokens computed again on resume")
    r = trace.release
    if r is None:
        return ("Release references", "The engine releases the request's references.", ["release"],
                ["finished"], "released")
    return ("Release this request's references",
            f"The engine drops the request's {len(r.block_ids)} block references ({took}).",
            ["release"], ["finished"],
            f"{len(r.block_ids)} block references dropped {_ids(r.block_ids)}: {r.num_kept_cached} kept "
            f"cached (reusable), {r.num_freed} freed, {r.num_still_shared} still shared")


def _chunk_work(chunk: ChunkTrace) -> str:
    """What a step computes for the request, in words."""
    positions = f"positions {chunk.start}..{chunk.start + chunk.num_tokens - 1}"
    tokens = f"{chunk.num_tokens} token{'s' if chunk.num_tokens != 1 else ''}"
    return {"prefill": f"prefill chunk of {tokens} ({positions})",
            "recompute": f"recompute chunk of {tokens} ({positions})",
            "decode": f"decode at position {chunk.start}"}[chunk.kind]


def _describe_batch_stage(seg: Segment, chunk: ChunkTrace, trace: RequestTrace,
                          block_size: int | None) -> Described:
    """The schedule, KV and execute stages of a step the request took part in: work for the whole batch."""
    took = _ms(seg.duration_ns)
    it = chunk.iteration
    what = _chunk_work(chunk)
    first_iteration = chunk is trace.chunks[0]
    if seg.kind is Stage.SCHEDULE:
        return ("Select runnable work" if first_iteration else "Schedule the next step",
                f"The scheduler builds step {it.index}: {what} ({took}).",
                ["state", "schedule"] if first_iteration else ["schedule"], ["admit"],
                f"step {it.index}: batch of {it.num_scheduled} requests, {it.num_batched_tokens} tokens; "
                f"this request: {what}")
    if seg.kind is Stage.KV:
        reuse = (f", reused {len(chunk.reused_block_ids)} cached {_ids(chunk.reused_block_ids)} "
                 f"({chunk.prefix_hit_tokens} prefix hit tokens)" if chunk.reused_block_ids else "")
        return ("Prepare KV capacity" if first_iteration else "Prepare the next KV mapping",
                f"The KV cache manager allocates blocks for the step ({took} for the whole batch).",
                ["kv"], ["allocate"],
                f"allocated {len(chunk.new_block_ids)} new blocks {_ids(chunk.new_block_ids)}{reuse}; "
                f"the table holds {chunk.num_blocks} blocks"
                + (f" of {block_size} tokens" if block_size else ""))
    return ("Execute the selected batch",
            f"The model runs one forward over the step's {it.num_batched_tokens} tokens"
            f" ({took}; forward {_ms(it.forward_ns)}).", ["execute"], ["run"],
            f"logits for {it.num_sampled} sampling rows of a batch of {it.num_scheduled}")


def _describe_sample(seg: Segment, chunk: ChunkTrace, decode: Callable[[Sequence[int]], str],
                     sampled_before: int) -> Described:
    """The sample stage: the request's token, or none while its prefill continues."""
    took = _ms(seg.duration_ns)
    if chunk.token_id is None:
        return ("Sample for the batch",
                f"The batch samples ({took}); this request's chunk ends inside its prompt, so it gets no "
                "token yet.", ["sample"], [], "no token: prefill continues")
    text = decode([chunk.token_id])
    ordinal = sampled_before + 1
    return ("Sample and stream the first token" if ordinal == 1 else f"Sample and stream token {ordinal}",
            f"The sampler picks token {chunk.token_id} ({took}).", ["sample"], ["sample-output"],
            f"token id {chunk.token_id} {text!r} (output token {ordinal})")


def _describe_update(seg: Segment, chunk: ChunkTrace, trace: RequestTrace) -> Described:
    """The update stage: the request's token appended and its stop checks, or its prompt progress."""
    took = _ms(seg.duration_ns)
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
