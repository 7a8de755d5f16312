"""Lifecycle tracing: per-iteration stage spans and per-request transitions, with two exports.

The engine owns an optional `Tracer` (`LLMEngine(config, tracer=Tracer())`; no tracer: nothing is
recorded). Each step it records one `IterationTrace` with the loop's stages on the engine clock:

    schedule -> kv (allocate / reuse) -> execute -> sample -> update -> release

and, for sampled requests, a `RequestTrace` of transitions: arrival, queued, admitted (prefix-hit tokens,
blocks allocated vs reused), each prefill chunk, first token, preempted / resumed, finished or aborted
with the reason, and the release of its block references (how many were freed, how many stay cached).

Everything is bounded: recent iterations and finished requests sit in ring buffers, and a request is
traced in detail with probability `sample_rate`. Exports:

- `chrome_trace`: Chrome trace-event JSON for Perfetto / chrome://tracing: one track for the engine loop
  with its stage spans, one track per request with its phases (queued, prefill, decode, preempted).
- `mechanism`: one real request as a scenario in the mechanism-diagram schema of the design seeds
  (targets state, schedule, kv, ...), each step's duration the measured time in ms.
- `dashboard_state`: the JSON snapshot the live dashboard polls.

The KV stage is measured by `TracedKVCacheManager`, which times the manager's lookups, allocations and
frees. Those calls interleave with the scheduler's decisions inside `schedule()`; exports show their summed
time as one span right after the scheduling span, so the two still add up to the measured `schedule()`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from tokenloop.core.kv_cache import KVBlock, KVCacheManager
from tokenloop.request import Clock, Request, RequestStatus, default_clock

if TYPE_CHECKING:  # annotations only: the engine imports this module
    from tokenloop.core.scheduler import ScheduledRequest, SchedulerOutput
    from tokenloop.engine import LLMEngine

STAGES = ("schedule", "kv", "execute", "sample", "update", "release")
"""The loop's stages in the order one iteration runs them (the seed diagram's node keys)."""

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

_NO_IDS: tuple[int, ...] = ()  # shared by the many chunks that take no new block


# ---- records ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class IterationTrace:
    """One engine step on the engine clock (ns): its stage boundaries and what it did.

    `kv_ns` is the part of [start, schedule_end] spent in KV lookups, allocations and frees;
    `release_ns` the part of [sample_end, end] spent releasing finished requests' blocks.
    `sample_end_ns` is the instant the step's tokens were stamped.
    """

    index: int
    start_ns: int
    schedule_end_ns: int
    execute_end_ns: int
    sample_end_ns: int
    end_ns: int
    kv_ns: int
    release_ns: int
    forward_ns: int
    num_scheduled: int
    num_batched_tokens: int
    num_prefill_tokens: int
    num_sampled: int
    num_admitted: int
    num_preempted: int
    num_finished: int
    blocks_allocated: int
    blocks_reused: int
    prefix_hit_tokens: int
    num_running: int
    num_waiting: int
    num_free_blocks: int

    def stage_ns(self) -> dict[str, int]:
        """Duration of each stage; they add up to `end_ns - start_ns`."""
        return {
            "schedule": self.schedule_end_ns - self.start_ns - self.kv_ns,
            "kv": self.kv_ns,
            "execute": self.execute_end_ns - self.schedule_end_ns,
            "sample": self.sample_end_ns - self.execute_end_ns,
            "update": self.end_ns - self.sample_end_ns - self.release_ns,
            "release": self.release_ns,
        }


@dataclass(slots=True)
class KVGrant:
    """What one successful `allocate` gave a request: new blocks, and cached blocks it reused."""

    new_block_ids: Sequence[int]
    reused_block_ids: Sequence[int]
    prefix_hit_tokens: int
    first: bool  # the request's first allocation since it held no blocks: admitted or resumed


@dataclass(slots=True)
class ChunkTrace:
    """One request's share of one iteration: positions [start, start + num_tokens)."""

    iteration: IterationTrace
    kind: str  # prefill, decode or recompute (after a preemption)
    start: int
    num_tokens: int
    new_block_ids: Sequence[int]
    reused_block_ids: Sequence[int]
    prefix_hit_tokens: int
    num_blocks: int  # blocks in the request's table after this iteration's allocation
    samples: bool
    token_id: int | None = None
    num_output_tokens: int = 0  # after this iteration's update


@dataclass(slots=True)
class RequestEvent:
    """One lifecycle transition of a traced request."""

    name: str  # arrival queued admitted prefill_chunk first_token preempted resumed finished aborted released
    ts_ns: int
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ReleaseTrace:
    """The drop of a finished request's block references, and where its blocks ended up."""

    start_ns: int
    end_ns: int
    block_ids: list[int]
    num_freed: int  # refcount 0 and no hash: plain free blocks, taken first
    num_kept_cached: int  # refcount 0 but hashed: reusable by a later prefix hit until evicted
    num_still_shared: int  # still referenced by other requests


@dataclass
class RequestTrace:
    """Everything recorded about one sampled request (a scheduler request: one sample of a group)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the request's own list: it grows as tokens are appended
    max_tokens: int | None
    arrival_ns: int
    events: list[RequestEvent] = field(default_factory=list)
    chunks: list[ChunkTrace] = field(default_factory=list)
    state: str = "queued"  # queued, running, preempted, finished
    recomputing: bool = False
    num_blocks: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_ns: int | None = None
    release: ReleaseTrace | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.release is not None

    @property
    def last_token_ns(self) -> int | None:
        for chunk in reversed(self.chunks):
            if chunk.token_id is not None:
                return chunk.iteration.sample_end_ns
        return None

    @property
    def e2e_ns(self) -> int | None:
        """Arrival to the last token (RequestTimes' e2e), or to the release for a request with no token."""
        last = self.last_token_ns
        if last is not None:
            return last - self.arrival_ns
        return None if self.release is None else self.release.start_ns - self.arrival_ns

    @property
    def lifetime_ns(self) -> int | None:
        """Arrival to the end of the release of its block references."""
        return None if self.release is None else self.release.end_ns - self.arrival_ns

    def sorted_events(self) -> list[RequestEvent]:
        # Chunk events are written at the end of their step, after a release during that step's update.
        return sorted(self.events, key=lambda e: e.ts_ns)


@dataclass(slots=True)
class RequestSummary:
    """Lifecycle times of any finished request (traced in detail or not), for the dashboard's Gantt."""

    request_id: str
    arrival_ns: int
    first_scheduled_ns: int | None
    first_token_ns: int | None
    last_token_ns: int | None
    end_ns: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    finish_reason: str | None

    @classmethod
    def of(cls, request: Request, end_ns: int) -> RequestSummary:
        t = request.times
        return cls(request.request_id, t.arrival, t.first_scheduled, t.first_token, t.last_token, end_ns,
                   request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens,
                   request.num_preemptions, request.finish_reason)


# ---- the KV stage's instrument ----------------------------------------------------------------------

class TracedKVCacheManager(KVCacheManager):
    """A `KVCacheManager` that times its verbs and remembers each step's grants, for the tracer.

    The engine uses it in place of the plain manager when it has a tracer; while the tracer is off it
    only adds one attribute check per call.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, tracer: Tracer,
                 clock: Clock = default_clock) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        self._tracer = tracer
        self._clock = clock
        self.elapsed_ns = 0
        self.grants: dict[str, KVGrant] = {}

    def take_step(self) -> tuple[int, dict[str, KVGrant]]:
        """This step's KV time and grants so far; both restart from zero."""
        elapsed, grants = self.elapsed_ns, self.grants
        self.elapsed_ns, self.grants = 0, {}
        return elapsed, grants

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        if not self._tracer.enabled:
            return super().get_computed_blocks(request)
        begin = self._clock()
        try:
            return super().get_computed_blocks(request)
        finally:
            self.elapsed_ns += self._clock() - begin

    def allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = (),
                 num_computed_from_cache: int = 0) -> list[KVBlock] | None:
        if not self._tracer.enabled:
            return super().allocate(request, num_new_tokens, computed_blocks, num_computed_from_cache)
        begin = self._clock()
        first = not self.holds_blocks(request.request_id)
        try:
            new_blocks = super().allocate(request, num_new_tokens, computed_blocks, num_computed_from_cache)
        finally:
            self.elapsed_ns += self._clock() - begin
        if new_blocks is not None:
            self.grants[request.request_id] = KVGrant(
                [b.block_id for b in new_blocks] if new_blocks else _NO_IDS,
                [b.block_id for b in computed_blocks] if computed_blocks else _NO_IDS,
                num_computed_from_cache, first)
        return new_blocks

    def free(self, request: Request) -> None:
        if not self._tracer.enabled:
            super().free(request)
            return
        begin = self._clock()
        try:
            super().free(request)
        finally:
            self.elapsed_ns += self._clock() - begin


# ---- the tracer -------------------------------------------------------------------------------------

class Tracer:
    """Records the engine loop's iterations and sampled requests' lifecycles, in bounded buffers.

    Args:
        enabled: record at all (may be switched at run time; off costs one check per hook).
        sample_rate: fraction of requests traced in detail (transitions, chunks, tokens). Iterations,
            the finished-request summaries and the TTFT series cover every request.
        max_iterations: recent iterations kept.
        max_requests: finished detailed traces kept (live ones are always kept).
        max_summaries: finished-request summaries kept for the dashboard.
        seed: seeds the request sampling, so a run is reproducible.

    The engine thread writes; other threads (HTTP handlers) read through the snapshot and export
    methods, which hold the same lock for the short time they copy.
    """

    def __init__(self, *, enabled: bool = True, sample_rate: float = 1.0, max_iterations: int = 2048,
                 max_requests: int = 256, max_summaries: int = 512, seed: int = 0) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate}")
        if min(max_iterations, max_requests, max_summaries) <= 0:
            raise ValueError("max_iterations, max_requests and max_summaries must be > 0")
        self._enabled = enabled
        self.sample_rate = sample_rate
        self.max_requests = max_requests
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._clock: Clock = default_clock
        self._engine: LLMEngine | None = None
        self._kv: TracedKVCacheManager | None = None
        self.origin_ns = self._clock()
        self.iterations: deque[IterationTrace] = deque(maxlen=max_iterations)
        self.summaries: deque[RequestSummary] = deque(maxlen=max_summaries)
        self.ttfts: deque[tuple[int, int]] = deque(maxlen=max_summaries)  # (first token ns, ttft ns)
        # Per-second buckets: [second since origin, output tokens, batched tokens, steps].
        self.throughput: deque[list[int]] = deque(maxlen=600)
        self._live: dict[str, RequestTrace] = {}
        self._done: OrderedDict[str, RequestTrace] = OrderedDict()
        self._released_in_step: list[str] = []
        self._in_step = False
        self._step_release_ns = 0
        self._step_finished = 0
        self._step_kv: tuple[int, dict[str, KVGrant]] = (0, {})
        self._num_iterations = 0
        self.totals = {"arrived": 0, "finished": 0, "aborted": 0, "errored": 0, "preemptions": 0,
                       "output_tokens": 0, "batched_tokens": 0}

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        """Switch recording; switching off ends the detailed traces of live requests where they stand."""
        with self._lock:
            if self._enabled and not value:
                # Their releases will not be seen: keep what was recorded, bounded like any finished trace.
                for request_id in list(self._live):
                    self._retire(request_id)
                self._released_in_step.clear()
            self._enabled = value
            self._in_step = False

    # ---- wiring --------------------------------------------------------------------------------------

    def attach(self, engine: LLMEngine, kv_cache: TracedKVCacheManager | None = None) -> None:
        """Bind to the engine that owns this tracer: its clock, its KV manager, its tokenizer and queues."""
        self._engine = engine
        self._clock = engine.clock
        self._kv = kv_cache
        self.origin_ns = self._clock()

    def kv_cache_manager(self, num_blocks: int, block_size: int, enable_caching: bool,
                         clock: Clock) -> TracedKVCacheManager:
        """The KV manager an engine with this tracer uses: the plain one, plus timing and grants."""
        return TracedKVCacheManager(num_blocks, block_size, enable_caching, self, clock)

    @property
    def block_size(self) -> int | None:
        return None if self._engine is None else self._engine.kv_cache.block_size

    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids as text with the engine's tokenizer ('' when unbound)."""
        if self._engine is None:
            return ""
        try:
            return self._engine.tokenizer.decode(list(token_ids), skip_special_tokens=False)
        except Exception:  # noqa: BLE001 - a trace must not fail on an odd token
            return ""

    # ---- hooks the engine calls ------------------------------------------------------------------------

    def on_arrival(self, request: Request) -> None:
        """A request joined the waiting queue."""
        now = self._clock()
        with self._lock:
            self.totals["arrived"] += 1
            if self.sample_rate < 1.0 and self._rng.random() >= self.sample_rate:
                return
            trace = RequestTrace(request.request_id, request.prompt, request.prompt_token_ids,
                                 request.output_token_ids, request.sampling_params.max_tokens, request.times.arrival)
            trace.events.append(RequestEvent("arrival", request.times.arrival,
                                             {"prompt_tokens": request.num_prompt_tokens}))
            trace.events.append(RequestEvent("queued", now, {"waiting": self._num_waiting()}))
            self._live[request.request_id] = trace

    def begin_step(self) -> int:
        """Start of a step: returns its start time and clears what a failed last step left behind."""
        if self._kv is not None:
            self._kv.take_step()
        if self._in_step:  # the last step raised before end_step: settle its releases now
            with self._lock:
                self._retire_released()
        self._in_step = True
        self._step_release_ns = 0
        self._step_finished = 0
        self._step_kv = (0, {})
        return self._clock()

    def end_schedule(self) -> int:
        """`schedule()` returned: keep the KV time and grants so far (later frees belong to release)."""
        if self._kv is not None:
            self._step_kv = self._kv.take_step()
        return self._clock()

    def on_release(self, request: Request, blocks: Sequence[KVBlock], start_ns: int, end_ns: int) -> None:
        """A request finished or was aborted and `blocks` (its table before the release) were released."""
        freed = kept = shared = 0
        for block in blocks:
            if block.ref_cnt > 0:
                shared += 1
            elif block.block_hash is not None:
                kept += 1
            else:
                freed += 1
        status = request.status
        with self._lock:
            key = {RequestStatus.FINISHED_ABORTED: "aborted", RequestStatus.FINISHED_ERROR: "errored"}.get(
                status, "finished")
            self.totals[key] += 1
            self.summaries.append(RequestSummary.of(request, end_ns))
            if self._in_step:
                self._step_release_ns += end_ns - start_ns
                self._step_finished += 1
            trace = self._live.get(request.request_id)
            if trace is None:
                return
            trace.finish_reason = request.finish_reason
            trace.stop_reason = request.stop_reason
            trace.state = "finished"
            finished_at = request.times.finished if request.times.finished is not None else start_ns
            reason = {"reason": request.finish_reason, "status": status.value}
            if request.stop_reason is not None:
                reason["stop_reason"] = request.stop_reason
            if request.error:
                reason["error"] = request.error
            name = "aborted" if status is RequestStatus.FINISHED_ABORTED else "finished"
            trace.events.append(RequestEvent(name, min(finished_at, start_ns), reason))
            trace.release = ReleaseTrace(start_ns, end_ns, [b.block_id for b in blocks], freed, kept, shared)
            trace.events.append(RequestEvent("released", end_ns, {
                "blocks": len(blocks), "freed": freed, "kept_cached": kept, "still_shared": shared}))
            if self._in_step:
                self._released_in_step.append(request.request_id)  # its last chunk is recorded at end_step
            else:
                self._retire(request.request_id)

    def end_step(self, schedule: SchedulerOutput, start_ns: int, schedule_end_ns: int, execute_end_ns: int,
                 sample_end_ns: int, forward_s: float, sampling: Sequence[Request],
                 token_ids: Sequence[int]) -> None:
        """Record a finished step. `sampling[i]` drew `token_ids[i]`; times are engine-clock ns."""
        end = self._clock()
        kv_ns, grants = self._step_kv
        self._step_kv = (0, {})
        scheduled = schedule.scheduled
        engine = self._engine
        num_prefill = 0
        for item in scheduled:
            if item.num_computed_tokens < item.request.num_prompt_tokens:
                num_prefill += item.num_tokens
        allocated = reused = hits = admitted = 0
        for grant in grants.values():
            allocated += len(grant.new_block_ids)
            reused += len(grant.reused_block_ids)
            hits += grant.prefix_hit_tokens
            admitted += grant.first
        with self._lock:
            self._num_iterations += 1
            it = IterationTrace(
                index=self._num_iterations, start_ns=start_ns, schedule_end_ns=schedule_end_ns,
                execute_end_ns=execute_end_ns, sample_end_ns=sample_end_ns, end_ns=end, kv_ns=kv_ns,
                release_ns=self._step_release_ns, forward_ns=int(forward_s * 1e9), num_scheduled=len(scheduled),
                num_batched_tokens=schedule.num_batched_tokens, num_prefill_tokens=num_prefill,
                num_sampled=len(sampling), num_admitted=admitted, num_preempted=len(schedule.preempted),
                num_finished=self._step_finished, blocks_allocated=allocated, blocks_reused=reused,
                prefix_hit_tokens=hits,
                num_running=engine.scheduler.num_running if engine is not None else 0,
                num_waiting=engine.scheduler.num_waiting if engine is not None else 0,
                num_free_blocks=engine.kv_cache.num_free_blocks if engine is not None else 0)
            self.iterations.append(it)
            self.totals["preemptions"] += len(schedule.preempted)
            self.totals["output_tokens"] += len(sampling)
            self.totals["batched_tokens"] += schedule.num_batched_tokens
            second = (end - self.origin_ns) // 1_000_000_000
            if self.throughput and self.throughput[-1][0] == second:
                bucket = self.throughput[-1]
                bucket[1] += len(sampling)
                bucket[2] += schedule.num_batched_tokens
                bucket[3] += 1
            else:
                self.throughput.append([second, len(sampling), schedule.num_batched_tokens, 1])
            for request in sampling:
                if request.num_output_tokens == 1 and request.times.first_token is not None:
                    self.ttfts.append((request.times.first_token, request.times.first_token - request.times.arrival))
            live = self._live
            if live:
                for request in schedule.preempted:
                    trace = live.get(request.request_id)
                    if trace is not None:
                        self._record_preemption(trace, it)
                for item in scheduled:
                    trace = live.get(item.request.request_id)
                    if trace is not None:
                        self._record_chunk(trace, item, it, grants.get(item.request.request_id))
                for request, token in zip(sampling, token_ids):
                    trace = live.get(request.request_id)
                    if trace is not None and trace.chunks and trace.chunks[-1].iteration is it:
                        self._record_token(trace, trace.chunks[-1], request, token, it)
            self._retire_released()
        self._in_step = False

    # ---- recording internals (under the lock) ----------------------------------------------------------

    def _num_waiting(self) -> int:
        return self._engine.scheduler.num_waiting if self._engine is not None else 0

    def _record_preemption(self, trace: RequestTrace, it: IterationTrace) -> None:
        trace.events.append(RequestEvent("preempted", it.start_ns, {
            "iteration": it.index, "blocks_released": trace.num_blocks,
            "tokens_to_recompute": trace.num_prompt_tokens + len(trace.output_token_ids)}))
        trace.state = "preempted"
        trace.num_blocks = 0
        trace.num_preemptions += 1

    def _record_chunk(self, trace: RequestTrace, item: ScheduledRequest, it: IterationTrace,
                      grant: KVGrant | None) -> None:
        request = item.request
        start = item.num_computed_tokens
        new_ids = grant.new_block_ids if grant is not None else _NO_IDS
        reused_ids = grant.reused_block_ids if grant is not None else _NO_IDS
        hit_tokens = grant.prefix_hit_tokens if grant is not None else 0
        if trace.state in ("queued", "preempted"):
            resumed = trace.state == "preempted"
            trace.recomputing = resumed
            trace.events.append(RequestEvent("resumed" if resumed else "admitted", it.start_ns, {
                "iteration": it.index, "prefix_hit_tokens": hit_tokens, "blocks_allocated": len(new_ids),
                "blocks_reused": len(reused_ids), "block_ids": list(item.block_ids), "batch_size": it.num_scheduled}))
            trace.state = "running"
        if trace.recomputing:
            kind = "recompute"
        elif start < request.num_prompt_tokens:
            kind = "prefill"
        else:
            kind = "decode"
        trace.num_blocks = len(item.block_ids)
        trace.chunks.append(ChunkTrace(it, kind, start, item.num_tokens, new_ids, reused_ids, hit_tokens,
                                       len(item.block_ids), item.samples, None, request.num_output_tokens))
        if kind != "decode":
            trace.events.append(RequestEvent("prefill_chunk", it.start_ns, {
                "iteration": it.index, "kind": kind, "positions": [start, start + item.num_tokens],
                "tokens": item.num_tokens, "batch_size": it.num_scheduled}))
        if item.samples:
            trace.recomputing = False

    def _record_token(self, trace: RequestTrace, chunk: ChunkTrace, request: Request, token: int,
                      it: IterationTrace) -> None:
        chunk.token_id = int(token)
        chunk.num_output_tokens = request.num_output_tokens
        if trace.first_token_ns is None:
            trace.first_token_ns = it.sample_end_ns
            trace.events.append(RequestEvent("first_token", it.sample_end_ns, {
                "token_id": int(token), "ttft_ms": (it.sample_end_ns - trace.arrival_ns) / 1e6}))

    def _retire_released(self) -> None:
        for request_id in self._released_in_step:
            self._retire(request_id)
        self._released_in_step.clear()

    def _retire(self, request_id: str) -> None:
        trace = self._live.pop(request_id, None)
        if trace is None:
            return
        self._done[request_id] = trace
        while len(self._done) > self.max_requests:
            self._done.popitem(last=False)

    # ---- reading ---------------------------------------------------------------------------------------

    def get(self, request_id: str) -> RequestTrace | None:
        """The detailed trace of a live or recently finished request, or None."""
        with self._lock:
            return self._live.get(request_id) or self._done.get(request_id)

    def resolve(self, request_id: str) -> str | None:
        """The traced id for `request_id`, accepting an API response id for its first prompt / sample."""
        with self._lock:
            for candidate in (request_id, f"{request_id}#0", f"{request_id}-0", f"{request_id}-0#0"):
                if candidate in self._live or candidate in self._done:
                    return candidate
        return None

    def request_ids(self) -> list[str]:
        """Traced requests, oldest finished first, then the live ones."""
        with self._lock:
            return list(self._done) + list(self._live)

    def chrome_trace(self, request_id: str | None = None) -> dict[str, Any]:
        """Chrome trace-event JSON: one request (and the iterations around it), or everything recent."""
        # Copy under the lock (the engine thread takes it every step), build the export outside it.
        with self._lock:
            if request_id is None:
                traces = [_snapshot(t) for t in list(self._done.values()) + list(self._live.values())]
                iterations = list(self.iterations)
            else:
                trace = self._live.get(request_id) or self._done.get(request_id)
                if trace is None:
                    raise KeyError(request_id)
                traces = [_snapshot(trace)]
                iterations = list(self.iterations)
        if request_id is not None:
            iterations = _iterations_of(traces[0], iterations)
        return to_chrome_trace(iterations, traces, self.origin_ns)

    def mechanism(self, request_id: str) -> dict[str, Any]:
        """The request as a mechanism-diagram scenario with measured durations (see `to_mechanism`)."""
        with self._lock:
            trace = self._live.get(request_id) or self._done.get(request_id)
            if trace is None:
                raise KeyError(request_id)
            trace = _snapshot(trace)
        return to_mechanism(trace, self.decode, self.block_size)

    def dashboard_state(self, max_iterations: int = 240, max_requests: int = 40) -> dict[str, Any]:
        """The live dashboard's snapshot: counters, KV blocks, recent iterations, requests and series."""
        now = self._clock()
        origin = self.origin_ns

        def ms(ns: int | None) -> float | None:
            return None if ns is None else round((ns - origin) / 1e6, 3)

        live_requests, counters, kv = self._engine_gauges()
        with self._lock:
            iterations = list(self.iterations)[-max_iterations:]
            summaries = list(self.summaries)[-max_requests:]
            ttfts = list(self.ttfts)[-200:]
            throughput = [list(b) for b in self.throughput][-120:]
            totals = dict(self.totals)
            preempted_spans = {rid: _preempted_spans(t) for rid, t in
                               list(self._live.items()) + list(self._done.items())[-max_requests:]}
            num_iterations = self._num_iterations
        requests = []
        for s in summaries:
            requests.append({
                "id": s.request_id, "state": "finished", "finish_reason": s.finish_reason,
                "arrival_ms": ms(s.arrival_ns), "admitted_ms": ms(s.first_scheduled_ns),
                "first_token_ms": ms(s.first_token_ns), "last_token_ms": ms(s.last_token_ns),
                "end_ms": ms(s.end_ns), "prompt_tokens": s.num_prompt_tokens, "output_tokens": s.num_output_tokens,
                "cached_tokens": s.num_cached_tokens, "preemptions": s.num_preemptions,
                "preempted": [[ms(a), ms(b)] for a, b in preempted_spans.get(s.request_id, [])]})
        for r in live_requests[:max_requests]:
            t = r.times
            requests.append({
                "id": r.request_id, "state": r.status.value, "finish_reason": None,
                "arrival_ms": ms(t.arrival), "admitted_ms": ms(t.first_scheduled), "first_token_ms": ms(t.first_token),
                "last_token_ms": ms(t.last_token), "end_ms": None, "prompt_tokens": r.num_prompt_tokens,
                "output_tokens": r.num_output_tokens, "cached_tokens": r.num_cached_tokens,
                "preemptions": r.num_preemptions,
                "preempted": [[ms(a), ms(b)] for a, b in preempted_spans.get(r.request_id, [])]})
        requests.sort(key=lambda q: q["arrival_ms"] or 0.0)
        return {
            "now_ms": ms(now),
            "tracing": {"enabled": self.enabled, "sample_rate": self.sample_rate},
            "counters": {**counters, "steps": num_iterations, **totals},
            "kv": kv,
            "iterations": [{
                "index": it.index, "start_ms": ms(it.start_ns), "end_ms": ms(it.end_ns),
                "stages_ms": {k: round(v / 1e6, 4) for k, v in it.stage_ns().items()},
                "forward_ms": round(it.forward_ns / 1e6, 4), "batch": it.num_scheduled,
                "tokens": it.num_batched_tokens, "prefill_tokens": it.num_prefill_tokens, "sampled": it.num_sampled,
                "admitted": it.num_admitted, "preempted": it.num_preempted, "finished": it.num_finished,
                "blocks_allocated": it.blocks_allocated, "blocks_reused": it.blocks_reused,
                "prefix_hit_tokens": it.prefix_hit_tokens, "running": it.num_running, "waiting": it.num_waiting,
                "free_blocks": it.num_free_blocks} for it in iterations],
            "requests": requests,
            "ttft": [[ms(t), round(v / 1e6, 3)] for t, v in ttfts],
            "throughput": [{"t_s": b[0], "output_tokens": b[1], "batched_tokens": b[2], "steps": b[3]}
                           for b in throughput],
        }

    def _engine_gauges(self) -> tuple[list[Request], dict[str, int], dict[str, Any]]:
        """Queue and block counts read from the engine (from any thread: reads of plain attributes)."""
        engine = self._engine
        if engine is None:
            return [], {"waiting": 0, "running": 0, "preempted": 0}, {}
        scheduler, kv = engine.scheduler, engine.kv_cache
        running = scheduler.running_requests()  # list copies: safe against the engine thread's changes
        waiting = scheduler.waiting_requests()
        preempted = sum(1 for r in waiting if r.status is RequestStatus.PREEMPTED)
        referenced = cached_free = 0
        for block in kv.pool.blocks:  # a fixed list: scanning it never races with its length
            if block.ref_cnt > 0:
                referenced += 1
            elif block.block_hash is not None:
                cached_free += 1
        total = kv.num_blocks
        queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        counters = {"waiting": len(waiting) - preempted, "running": len(running), "preempted": preempted}
        blocks = {"num_blocks": total, "block_size": kv.block_size, "referenced": referenced,
                  "cached_free": cached_free, "free": total - referenced - cached_free,
                  "prefix_cache_hit_rate": hits / queries if queries else 0.0, "evictions": kv.evictions}
        return running + waiting, counters, blocks


def _snapshot(trace: RequestTrace) -> RequestTrace:
    """A copy of `trace` whose lists the engine thread no longer appends to (taken under the lock)."""
    return dataclasses.replace(trace, events=list(trace.events), chunks=list(trace.chunks),
                               output_token_ids=list(trace.output_token_ids))


def _iterations_of(trace: RequestTrace, recent: Iterable[IterationTrace]) -> list[IterationTrace]:
    """The request's own iterations plus the recent ones inside its lifetime, in order."""
    by_index = {chunk.iteration.index: chunk.iteration for chunk in trace.chunks}
    end = trace.release.end_ns if trace.release is not None else None
    for it in recent:
        if it.end_ns >= trace.arrival_ns and (end is None or it.start_ns <= end):
            by_index.setdefault(it.index, it)
    return [by_index[i] for i in sorted(by_index)]


def _preempted_spans(trace: RequestTrace) -> list[tuple[int, int]]:
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
                           ("sample", it.execute_end_ns, it.sample_end_ns), ("update", it.sample_end_ns, end)):
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
        {"ph": "M", "pid": _ENGINE_PID, "tid": 0, "name": "process_name", "args": {"name": "tokenloop engine"}},
        {"ph": "M", "pid": _ENGINE_PID, "tid": _LOOP_TID, "name": "thread_name", "args": {"name": "engine loop"}},
        {"ph": "M", "pid": _ENGINE_PID, "tid": _LOOP_TID, "name": "thread_sort_index", "args": {"sort_index": 0}},
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
            "batch": it.num_scheduled, "tokens": it.num_batched_tokens, "prefill_tokens": it.num_prefill_tokens,
            "sampled": it.num_sampled, "admitted": it.num_admitted, "preempted": it.num_preempted,
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
    return {k: (v if isinstance(v, (int, float, str, bool, list, type(None))) else str(v)) for k, v in args.items()}


# ---- mechanism-diagram export -------------------------------------------------------------------------------

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
        title, description, active, paths, artifact = _describe(seg, trace, decode, block_size, sampled_before)
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
        "description": ("One real request through tokenloop's serving loop: it waits in the queue, is admitted "
                        "with KV blocks allocated or reused from the prefix cache, runs in batches, samples one "
                        "token per step, returns to scheduling while unfinished, and releases its block "
                        "references when it completes. " + summary),
        "caption": (f"Request {trace.request_id}, recorded by tokenloop's tracer. Output: {text!r}. "
                    "Step durations are measured engine time, not illustrative playback time."),
        "alt": ("Serving-loop flow for one measured request: queue, scheduler, KV allocation and reuse, model "
                "executor, sampling and update repeated per generated token, then release of references."),
        "sources": [
            {"path": "tokenloop/tracing.py", "sha256": _file_sha256(here),
             "description": "Tracer that recorded the iterations and transitions, and this export."},
            {"path": "tokenloop/engine.py", "sha256": _file_sha256(here.parent / "engine.py"),
             "description": "The engine loop whose stages were timed."},
        ],
        "limitations": [
            "Durations are one measured run on one machine; they vary from run to run.",
            "KV lookups and allocations interleave with scheduling decisions inside one call; their summed "
            "time is shown as the KV step after the scheduling step.",
            "Stages are per batch: a request shares each step's schedule, execute, sample and update time with "
            "the other requests in its batch.",
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


def _describe(seg: Segment, trace: RequestTrace, decode: Callable[[Sequence[int]], str], block_size: int | None,
              sampled_before: int) -> tuple[str, str, list[str], list[str], str]:
    """Title, description, active targets, paths and artifact of one step."""
    chunk = seg.chunk
    took = _ms(seg.duration_ns)
    if seg.kind == "queue":
        return ("Wait in the queue", f"The request waits in the scheduler's queue until a step admits it ({took}).",
                ["state"], [], f"{trace.num_prompt_tokens} prompt tokens waiting; queue wait {took}")
    if seg.kind == "wait":
        return ("Return to scheduling", f"The unfinished request returns to scheduling ({took} until the next "
                "step that serves it).", ["schedule"], ["unfinished"],
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
                f"step {it.index}: batch of {it.num_scheduled} requests, {it.num_batched_tokens} tokens; this "
                f"request: {what}")
    if seg.kind == "kv":
        reuse = (f", reused {len(chunk.reused_block_ids)} cached {_ids(chunk.reused_block_ids)} "
                 f"({chunk.prefix_hit_tokens} prefix hit tokens)" if chunk.reused_block_ids else "")
        return ("Prepare KV capacity" if first_iteration else "Prepare the next KV mapping",
                f"The KV cache manager allocates blocks for the step ({took} for the whole batch).",
                ["kv"], ["allocate"],
                f"allocated {len(chunk.new_block_ids)} new blocks {_ids(chunk.new_block_ids)}{reuse}; the table "
                f"holds {chunk.num_blocks} blocks" + (f" of {block_size} tokens" if block_size else ""))
    if seg.kind == "execute":
        return ("Execute the selected batch", f"The model runs one forward over the step's {it.num_batched_tokens} "
                f"tokens ({took}; forward {_ms(it.forward_ns)}).", ["execute"], ["run"],
                f"logits for {it.num_sampled} sampling rows of a batch of {it.num_scheduled}")
    if seg.kind == "sample":
        if chunk.token_id is None:
            return ("Sample for the batch", f"The batch samples ({took}); this request's chunk ends inside its "
                    "prompt, so it gets no token yet.", ["sample"], [], "no token: prefill continues")
        text = decode([chunk.token_id])
        ordinal = sampled_before + 1
        return ("Sample and stream the first token" if ordinal == 1 else f"Sample and stream token {ordinal}",
                f"The sampler picks token {chunk.token_id} ({took}).", ["sample"], ["sample-output"],
                f"token id {chunk.token_id} {text!r} (output token {ordinal})")
    # update
    if seg.last and trace.finish_reason is not None:
        reason = trace.finish_reason + (f" ({trace.stop_reason!r})" if trace.stop_reason is not None else "")
        return ("Set request status to completed", f"The engine appends the token and the completion check ends "
                f"the request: {reason} ({took}).", ["update"], ["update-output"],
                f"finished: {reason}; {chunk.num_output_tokens} output tokens")
    if chunk.token_id is None:
        done = chunk.start + chunk.num_tokens
        return ("Update state", f"The engine records the computed prompt tokens ({took}).", ["update"],
                ["update-output"], f"{done} of {trace.num_prompt_tokens + (chunk.num_output_tokens or 0)} tokens "
                "computed; unfinished")
    limit = trace.max_tokens if trace.max_tokens is not None else math.inf
    return ("Add ID and do a completion check", f"The engine appends token {chunk.token_id} and checks the stop "
            f"conditions ({took}).", ["update"], ["update-output"],
            f"{chunk.num_output_tokens} of at most {limit} output tokens; the request stays unfinished")
