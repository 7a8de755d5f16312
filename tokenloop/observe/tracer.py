"""Lifecycle tracing: an observer that keeps the engine's records as step summaries and request traces.

    tracer = Tracer(sample_rate=0.1)
    engine = LLMEngine(config, tracer=tracer)  # the engine adds it to its observers and calls bind()

From each `StepRecord` the tracer keeps one `IterationTrace` (the loop's stages on the engine clock:
schedule -> kv -> execute -> sample -> update -> release) and, for requests sampled for detail, a
`RequestTrace` of transitions: arrival, queued, admitted (prefix-hit tokens, blocks allocated vs reused),
each prefill chunk, first token, preempted / resumed, finished or aborted with the reason, and the release
of its block references (freed, kept cached, still shared). Summaries of every finished request, the TTFT
series, throughput and the live-request table cover every request, sampled or not.

It holds no engine: only records, the tokenizer (to decode token ids in exports) and the engine clock.
Everything is bounded: ring buffers for steps, finished traces and summaries; live traces end with their
requests. The observer thread writes under the tracer's lock; readers (HTTP handlers) copy under it and
build their exports outside it.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any, Protocol

from tokenloop.observe import dashboard
from tokenloop.observe.exports import iterations_of, to_chrome_trace
from tokenloop.observe.live import LiveState
from tokenloop.observe.mechanism import to_mechanism
from tokenloop.observe.records import (
    ArrivalRecord,
    HandoffRecord,
    ReleaseInfo,
    ScheduledChunk,
    StepRecord,
)
from tokenloop.observe.traces import (
    ChunkTrace,
    IterationTrace,
    ReleaseTrace,
    RequestEvent,
    RequestSummary,
    RequestTrace,
)
from tokenloop.request import Clock, RequestStatus, default_clock

_TOTAL_KEY = {RequestStatus.FINISHED_ABORTED: "aborted", RequestStatus.FINISHED_ERROR: "errored"}


class Decodes(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class Tracer:
    """Records the engine loop's steps and sampled requests' lifecycles, in bounded buffers.

    Args:
        enabled: record at all (may be switched at run time; off costs one check per record).
        sample_rate: fraction of requests traced in detail (transitions, chunks, tokens). Steps, the
            finished-request summaries, the TTFT series and the live-request table cover every request.
        max_iterations: recent steps kept.
        max_requests: finished detailed traces kept (live ones are always kept).
        max_summaries: finished-request summaries (and TTFT points) kept for the dashboard.
        seed: seeds the request sampling, so a run is reproducible.
        tokenizer, block_size, clock: as `bind` takes them, for a tracer fed without an `LLMEngine`.
    """

    def __init__(self, *, enabled: bool = True, sample_rate: float = 1.0, max_iterations: int = 2048,
                 max_requests: int = 256, max_summaries: int = 512, seed: int = 0,
                 tokenizer: Decodes | None = None, block_size: int | None = None,
                 clock: Clock = default_clock) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate}")
        if min(max_iterations, max_requests, max_summaries) <= 0:
            raise ValueError("max_iterations, max_requests and max_summaries must be > 0")
        self._enabled = enabled
        self.sample_rate = sample_rate
        self.max_requests = max_requests
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._tokenizer = tokenizer
        self.block_size = block_size
        self._clock = clock
        self.origin_ns = clock()
        self.iterations: deque[IterationTrace] = deque(maxlen=max_iterations)
        self.summaries: deque[RequestSummary] = deque(maxlen=max_summaries)
        self.ttfts: deque[tuple[int, int]] = deque(maxlen=max_summaries)  # (first token ns, ttft ns)
        # Per-second buckets: [second since origin, output tokens, batched tokens, steps].
        self.throughput: deque[list[int]] = deque(maxlen=600)
        # Per engine replica (one for a single core): its live requests (sampled or not) and gauges.
        self._now: dict[int, LiveState] = {}
        self._live: dict[str, RequestTrace] = {}
        self._done: OrderedDict[str, RequestTrace] = OrderedDict()
        self.totals = {"arrived": 0, "finished": 0, "aborted": 0, "errored": 0, "preemptions": 0,
                       "output_tokens": 0, "batched_tokens": 0, "handoffs": 0}

    def bind(self, tokenizer: Decodes | None, block_size: int | None, clock: Clock) -> None:
        """Take the engine's tokenizer, block size and clock (the origin of exports restarts at its now)."""
        with self._lock:
            self._tokenizer = tokenizer
            self.block_size = block_size
            self._clock = clock
            self.origin_ns = clock()

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
                for state in self._now.values():
                    state.clear()
            self._enabled = value

    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids as text with the bound tokenizer ('' when unbound)."""
        if self._tokenizer is None:
            return ""
        try:
            return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)
        except Exception:  # noqa: BLE001 - a trace must not fail on an odd token
            return ""

    # ---- the records ---------------------------------------------------------------------------------

    def on_arrival(self, record: ArrivalRecord) -> None:
        """A request joined the waiting queue."""
        if not self._enabled:
            return
        with self._lock:
            self.totals["arrived"] += 1
            self._state(record.replica).arrival(record)
            if self.sample_rate < 1.0 and self._rng.random() >= self.sample_rate:
                return
            trace = RequestTrace(record.request_id, record.prompt, list(record.prompt_token_ids), [],
                                 record.max_tokens, record.arrival_ns, lora_name=record.lora_name)
            arrival: dict[str, object] = {"prompt_tokens": len(record.prompt_token_ids)}
            if record.lora_name is not None:
                arrival["lora_adapter"] = record.lora_name
            trace.events.append(RequestEvent("arrival", record.arrival_ns, arrival))
            if record.route is not None:  # a cluster's router chose the replica
                trace.events.append(RequestEvent("routed", record.queued_ns, dict(record.route)))
            trace.events.append(RequestEvent("queued", record.queued_ns, {"waiting": record.num_waiting,
                                                                           "replica": record.replica}))
            self._live[record.request_id] = trace

    def on_step(self, record: StepRecord) -> None:
        """One step: its summary, every request's progress, and the detail of the sampled ones."""
        if not self._enabled:
            return
        with self._lock:
            firsts = self._state(record.replica).step(record)
            for row in firsts:
                self.ttfts.append((record.sample_end_ns, record.sample_end_ns - row.arrival_ns))
            totals = self.totals
            totals["preemptions"] += len(record.preempted)
            totals["output_tokens"] += len(record.sampled_ids)
            totals["batched_tokens"] += record.num_batched_tokens
            it = None
            if record.scheduled:  # a record with nothing scheduled only carries preemptions or releases
                it = IterationTrace.of(record)
                self.iterations.append(it)
                self._count_throughput(it)
            live = self._live
            if live:
                for request_id in record.preempted:
                    trace = live.get(request_id)
                    if trace is not None:
                        self._record_preemption(trace, record)
                if it is not None:
                    for chunk in record.scheduled:
                        trace = live.get(chunk.request_id)
                        if trace is not None:
                            self._record_chunk(trace, chunk, it)
                    for request_id, token in zip(record.sampled_ids, record.sampled_tokens):
                        trace = live.get(request_id)
                        if trace is not None and trace.chunks and trace.chunks[-1].iteration is it:
                            self._record_token(trace, trace.chunks[-1], token, it)
            self._record_releases(record.releases)

    def on_release(self, records: list[ReleaseInfo]) -> None:
        """Requests that ended between steps (aborted, or stopped by the front end's stop string)."""
        if not self._enabled:
            return
        with self._lock:
            for record in records:
                self._state(record.replica).release([record])
            self._record_releases(records)

    def on_handoff(self, record: HandoffRecord) -> None:
        """A request moving between replicas: an event in its trace; its live row follows it."""
        if not self._enabled:
            return
        with self._lock:
            if record.event == "completed":
                self.totals["handoffs"] += 1
            if record.event == "imported":
                row = self._state(record.source).rows.pop(record.request_id, None)
                if row is not None:
                    self._state(record.destination).rows[record.request_id] = row
            trace = self._live.get(record.request_id)
            if trace is not None:
                detail: dict[str, Any] = {"source": record.source, "destination": record.destination,
                                          "reason": record.reason}
                if record.detail:
                    detail["detail"] = record.detail
                if record.blocks_copied or record.blocks_matched or record.bytes_moved:
                    detail.update(blocks_copied=record.blocks_copied, blocks_matched=record.blocks_matched,
                                  bytes_moved=record.bytes_moved)
                trace.events.append(RequestEvent(f"handoff_{record.event}", record.ts_ns, detail))

    def _state(self, replica: int) -> LiveState:
        state = self._now.get(replica)
        if state is None:
            state = self._now[replica] = LiveState()
        return state

    # ---- recording internals (under the lock) ----------------------------------------------------------

    def _count_throughput(self, it: IterationTrace) -> None:
        second = (it.end_ns - self.origin_ns) // 1_000_000_000
        if self.throughput and self.throughput[-1][0] == second:
            bucket = self.throughput[-1]
            bucket[1] += it.num_sampled
            bucket[2] += it.num_batched_tokens
            bucket[3] += 1
        else:
            self.throughput.append([second, it.num_sampled, it.num_batched_tokens, 1])

    def _record_preemption(self, trace: RequestTrace, record: StepRecord) -> None:
        trace.events.append(RequestEvent("preempted", record.start_ns, {
            "iteration": record.index, "blocks_released": len(trace.block_ids),
            "tokens_to_recompute": trace.num_prompt_tokens + len(trace.output_token_ids)}))
        trace.state = RequestStatus.PREEMPTED
        trace.block_ids = []
        trace.num_preemptions += 1

    def _record_chunk(self, trace: RequestTrace, chunk: ScheduledChunk, it: IterationTrace) -> None:
        new_ids = chunk.allocated_block_ids
        reused_ids = chunk.reused_block_ids
        if chunk.admitted:
            trace.block_ids = list(chunk.new_block_ids)
        else:
            trace.block_ids.extend(chunk.new_block_ids)
        if trace.state in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            resumed = trace.state is RequestStatus.PREEMPTED
            trace.recomputing = resumed
            trace.events.append(RequestEvent("resumed" if resumed else "admitted", it.start_ns, {
                "iteration": it.index, "prefix_hit_tokens": chunk.prefix_hit_tokens,
                "blocks_allocated": len(new_ids), "blocks_reused": len(reused_ids),
                "block_ids": list(trace.block_ids), "batch_size": it.num_scheduled}))
            trace.state = RequestStatus.RUNNING
        if trace.recomputing:
            kind = "recompute"
        elif chunk.start < chunk.num_prompt_tokens:
            kind = "prefill"
        else:
            kind = "decode"
        trace.chunks.append(ChunkTrace(it, kind, chunk.start, chunk.num_tokens, new_ids, reused_ids,
                                       chunk.prefix_hit_tokens, chunk.num_blocks, chunk.samples, None,
                                       len(trace.output_token_ids)))
        if kind != "decode":
            trace.events.append(RequestEvent("prefill_chunk", it.start_ns, {
                "iteration": it.index, "kind": kind,
                "positions": [chunk.start, chunk.start + chunk.num_tokens], "tokens": chunk.num_tokens,
                "batch_size": it.num_scheduled}))
        if chunk.samples:
            trace.recomputing = False

    def _record_token(self, trace: RequestTrace, chunk: ChunkTrace, token: int, it: IterationTrace) -> None:
        trace.output_token_ids.append(int(token))
        chunk.token_id = int(token)
        chunk.num_output_tokens = len(trace.output_token_ids)
        if trace.first_token_ns is None:
            trace.first_token_ns = it.sample_end_ns
            trace.events.append(RequestEvent("first_token", it.sample_end_ns, {
                "token_id": int(token), "ttft_ms": (it.sample_end_ns - trace.arrival_ns) / 1e6}))

    def _record_releases(self, infos: list[ReleaseInfo]) -> None:
        for info in infos:
            if info.status is RequestStatus.HANDED_OFF:  # it lives on in another replica: a transition, not an end
                trace = self._live.get(info.request_id)
                if trace is not None:
                    trace.events.append(RequestEvent("handoff_released", info.end_ns, {
                        "replica": info.replica, "blocks": len(info.block_ids),
                        "kept_cached": info.num_kept_cached, "still_shared": info.num_still_shared}))
                continue
            self.totals[_TOTAL_KEY.get(info.status, "finished")] += 1
            self.summaries.append(RequestSummary.of(info))
            trace = self._live.get(info.request_id)
            if trace is None:
                continue
            trace.finish_reason = info.finish_reason
            trace.stop_reason = info.stop_reason
            trace.state = info.status
            reason: dict[str, Any] = {"reason": info.finish_reason, "status": info.status.value}
            if info.stop_reason is not None:
                reason["stop_reason"] = info.stop_reason
            if info.error:
                reason["error"] = info.error
            name = "aborted" if info.status is RequestStatus.FINISHED_ABORTED else "finished"
            trace.events.append(RequestEvent(name, min(info.finished_ns, info.start_ns), reason))
            trace.release = ReleaseTrace(info.start_ns, info.end_ns, list(info.block_ids), info.num_freed,
                                         info.num_kept_cached, info.num_still_shared)
            trace.events.append(RequestEvent("released", info.end_ns, {
                "blocks": len(info.block_ids), "freed": info.num_freed, "kept_cached": info.num_kept_cached,
                "still_shared": info.num_still_shared}))
            self._retire(info.request_id)

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
        """Chrome trace-event JSON: one request (and the steps around it), or everything recent."""
        with self._lock:
            if request_id is None:
                traces = [_snapshot(t) for t in list(self._done.values()) + list(self._live.values())]
            else:
                trace = self._live.get(request_id) or self._done.get(request_id)
                if trace is None:
                    raise KeyError(request_id)
                traces = [_snapshot(trace)]
            iterations = list(self.iterations)
            origin = self.origin_ns
        if request_id is not None:
            iterations = iterations_of(traces[0], iterations)
        return to_chrome_trace(iterations, traces, origin)

    def mechanism(self, request_id: str) -> dict[str, Any]:
        """The request as a mechanism-diagram scenario with measured durations (see `to_mechanism`)."""
        with self._lock:
            trace = self._live.get(request_id) or self._done.get(request_id)
            if trace is None:
                raise KeyError(request_id)
            trace = _snapshot(trace)
        return to_mechanism(trace, self.decode, self.block_size)

    def dashboard_state(self, max_iterations: int = 240, max_requests: int = 40) -> dict[str, Any]:
        """The live dashboard's snapshot: counters, KV blocks, recent steps, requests and series."""
        with self._lock:
            snapshot = dashboard.Snapshot(
                now_ns=self._clock(), origin_ns=self.origin_ns, enabled=self._enabled,
                sample_rate=self.sample_rate, iterations=list(self.iterations)[-max_iterations:],
                summaries=list(self.summaries)[-max_requests:],
                live=[dataclasses.replace(r) for state in self._now.values()
                      for r in state.rows.values()][:max_requests],
                gauges=dashboard.sum_gauges([s.gauges for s in self._now.values() if s.gauges is not None]),
                replicas={i: dataclasses.replace(s.gauges) for i, s in sorted(self._now.items())
                          if s.gauges is not None},
                ttfts=list(self.ttfts)[-200:], throughput=[list(b) for b in self.throughput][-120:],
                totals=dict(self.totals),
                preempted_spans={rid: dashboard.preempted_spans(t) for rid, t in
                                 list(self._live.items()) + list(self._done.items())[-max_requests:]},
                num_steps=self.iterations[-1].index if self.iterations else 0)
        return dashboard.build_state(snapshot)


def _snapshot(trace: RequestTrace) -> RequestTrace:
    """A copy of `trace` whose lists the observer thread no longer appends to (taken under the lock)."""
    return dataclasses.replace(trace, events=list(trace.events), chunks=list(trace.chunks),
                               output_token_ids=list(trace.output_token_ids), block_ids=list(trace.block_ids))
