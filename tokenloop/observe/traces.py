"""What the tracer keeps: compact step summaries, and the detailed lifecycle of sampled requests.

Built by `Tracer` from the engine's records (`tokenloop.observe.records`); read by the exports. Plain
values only: nothing here points back into the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenloop.observe.records import ReleaseInfo, Stage, StepRecord, stage_durations
from tokenloop.request import RequestStatus


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

    @classmethod
    def of(cls, record: StepRecord) -> IterationTrace:
        """The step's summary: counts instead of the record's per-request lists."""
        allocated = reused = hits = admitted = 0
        for chunk in record.scheduled:
            allocated += len(chunk.new_block_ids) - chunk.num_reused_blocks
            reused += chunk.num_reused_blocks
            hits += chunk.prefix_hit_tokens
            admitted += chunk.admitted
        g = record.gauges
        return cls(record.index, record.start_ns, record.schedule_end_ns, record.execute_end_ns,
                   record.sample_end_ns, record.end_ns, record.kv_ns, record.release_ns, record.forward_ns,
                   len(record.scheduled), record.num_batched_tokens, record.num_prefill_tokens,
                   len(record.sampled_ids), admitted, len(record.preempted), len(record.releases), allocated,
                   reused, hits, g.num_running, g.num_waiting, g.num_free_blocks)

    def stage_ns(self) -> dict[Stage, int]:
        """Duration of each stage; they add up to `end_ns - start_ns`."""
        return stage_durations(self)




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
    output_token_ids: list[int]  # from the steps' sampled tokens
    max_tokens: int | None
    arrival_ns: int
    events: list[RequestEvent] = field(default_factory=list)
    chunks: list[ChunkTrace] = field(default_factory=list)
    state: RequestStatus = RequestStatus.WAITING  # then running, preempted, and how it finished
    recomputing: bool = False
    block_ids: list[int] = field(default_factory=list)  # its block table, rebuilt from the grants
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_ns: int | None = None
    release: ReleaseTrace | None = None
    lora_name: str | None = None  # the LoRA adapter it ran with; None: the base model

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
    def of(cls, info: ReleaseInfo) -> RequestSummary:
        return cls(info.request_id, info.arrival_ns, info.first_scheduled_ns, info.first_token_ns,
                   info.last_token_ns, info.end_ns, info.num_prompt_tokens, info.num_output_tokens,
                   info.num_cached_tokens, info.num_preemptions, info.finish_reason)

