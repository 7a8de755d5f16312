"""What the engine reports, as data: one `StepRecord` per step, a `ReleaseInfo` per ended request.

The engine core builds these and hands them to observers (the tracer, the Prometheus collector, a
simulator's calibration); observers never hold the engine or call back into it. Every field is a plain
value (ints, strings, lists), so a record crosses a process boundary as it is.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Protocol

from tokenloop.request import FinishReason, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of one step: positions [start, start + num_tokens), and its KV grant."""

    request_id: str
    start: int
    num_tokens: int
    num_prompt_tokens: int
    samples: bool  # the chunk reaches the end of the request's known tokens: the step samples for it
    new_block_ids: list[int]  # blocks appended to its table this step (an admission: reused ones first)
    num_reused_blocks: int  # leading entries of new_block_ids that came from the prefix cache
    prefix_hit_tokens: int
    admitted: bool  # its first allocation since it held no blocks: admitted, or resumed after preemption
    num_blocks: int  # blocks in its table after this step's allocation

    @property
    def reused_block_ids(self) -> list[int]:
        return self.new_block_ids[:self.num_reused_blocks]

    @property
    def allocated_block_ids(self) -> list[int]:
        """Blocks taken from the free queue for new tokens (not prefix hits)."""
        return self.new_block_ids[self.num_reused_blocks:]


@dataclass(slots=True)
class ReleaseInfo:
    """A request ended and dropped its block references; where those blocks went, and its life in brief."""

    request_id: str
    status: RequestStatus  # finished (stopped, length, aborted, error) or handed off
    finish_reason: FinishReason | None  # None when handed off
    stop_reason: int | str | None
    error: str | None
    block_ids: list[int]  # its table before the release
    num_freed: int  # refcount 0 and no hash: plain free blocks
    num_kept_cached: int  # refcount 0 but hashed: reusable by a later prefix hit until evicted
    num_still_shared: int  # still referenced by other requests
    start_ns: int  # the release itself
    end_ns: int
    arrival_ns: int
    first_scheduled_ns: int | None
    first_token_ns: int | None
    last_token_ns: int | None
    finished_ns: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    replica: int = 0  # which engine replica of a cluster (set by the front door's replica set)


@dataclass(slots=True)
class StepGauges:
    """Queue and pool state at the end of a step (cumulative counters included)."""

    num_running: int
    num_waiting: int  # preempted ones included
    num_preempted_waiting: int
    num_blocks: int
    block_size: int
    num_free_blocks: int  # not referenced (cached or not)
    num_cached_free_blocks: int  # not referenced but still hashed: reusable
    prefix_cache_queries: int  # tokens, cumulative
    prefix_cache_hits: int
    evictions: int
    num_preemptions: int  # cumulative

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(slots=True)
class StepRecord:
    """One step of the loop on the engine clock (ns): stage boundaries and what each stage did.

    Stages tile [start_ns, end_ns]: schedule (kv_ns of it in KV lookups and allocations), execute
    (forward_ns of it in the model forward), sample, update (release_ns of it releasing finished requests).
    """

    index: int
    start_ns: int
    schedule_end_ns: int
    execute_end_ns: int
    sample_end_ns: int  # the instant the step's tokens are stamped with
    end_ns: int
    kv_ns: int
    forward_ns: int
    release_ns: int
    num_batched_tokens: int
    scheduled: list[ScheduledChunk]
    preempted: list[str]  # request ids preempted (by recompute) in this step's scheduling
    sampled_ids: list[str]  # sampled_ids[i] drew sampled_tokens[i]
    sampled_tokens: list[int]
    releases: list[ReleaseInfo]  # requests that ended in this step (stopped, length, error)
    gauges: StepGauges
    weight_form: str = ""  # the form the projections ran in (int4, bfloat16, ...)
    replica: int = 0  # which engine replica of a cluster (set by the front door's replica set)
    # Speculative decoding: draft tokens verified this step, and how many of them the model agreed with.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def num_scheduled(self) -> int:
        return len(self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.scheduled if c.start < c.num_prompt_tokens)

    def stage_ns(self) -> dict[Stage, int]:
        """Duration of each stage; they add up to `end_ns - start_ns`."""
        return stage_durations(self)


class _StageBounds(Protocol):
    start_ns: int
    schedule_end_ns: int
    execute_end_ns: int
    sample_end_ns: int
    end_ns: int
    kv_ns: int
    release_ns: int


class Stage(enum.StrEnum):
    """A stage of one step of the loop; equal to its value, so records and the dashboard's JSON carry it."""

    SCHEDULE = "schedule"
    KV = "kv"
    EXECUTE = "execute"
    SAMPLE = "sample"
    UPDATE = "update"
    RELEASE = "release"


STAGES: tuple[Stage, ...] = tuple(Stage)
"""The loop's stages in the order one iteration runs them: the one list the tracer, the exports and the
dashboard (served to its page) use."""


def stage_durations(step: _StageBounds) -> dict[Stage, int]:
    """The loop's stages of one step, from its boundaries: they tile [start_ns, end_ns]."""
    return dict(zip(STAGES, (step.schedule_end_ns - step.start_ns - step.kv_ns, step.kv_ns,
                             step.execute_end_ns - step.schedule_end_ns, step.sample_end_ns - step.execute_end_ns,
                             step.end_ns - step.sample_end_ns - step.release_ns, step.release_ns), strict=True))


@dataclass(slots=True)
class ArrivalRecord:
    """A request (one sample of a user request) joined the engine's queue."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    max_tokens: int | None
    arrival_ns: int
    queued_ns: int
    num_waiting: int  # the queue's length once it joined
    replica: int = 0  # which engine replica of a cluster took it
    # The router's decision (replica, policy, predicted TTFT, cached tokens), when a router chose.
    route: dict[str, int | float | str | None] | None = None
    lora_name: str | None = None  # the LoRA adapter it runs with; None: the base model


@dataclass(slots=True)
class HandoffRecord:
    """One transition of a request's handoff between replicas: exporting (pre-copy starts), precopied,
    paused (the export: its stream stops), in_transit, imported (it runs on the destination), completed
    (the source released it), refused (it resumed on the source), cancelled, failed, finished."""

    request_id: str
    event: str
    source: int
    destination: int
    reason: str  # drain, migrate, disaggregation
    ts_ns: int
    detail: str | None = None  # a refusal's or failure's reason
    blocks_copied: int = 0
    blocks_matched: int = 0  # found by hash at the destination: not moved
    bytes_moved: int = 0  # KV bytes this transition moved (pre-copied blocks, then the snapshot's)


class EngineObserver:
    """Receives the engine's records; every method is optional (the defaults ignore the record).

    Called on the thread that runs the loop (or, across a process boundary, the thread that receives
    the records): keep the work short, and copy under your own lock what other threads read.
    """

    def on_arrival(self, record: ArrivalRecord) -> None:  # an optional hook: empty on purpose
        pass

    def on_step(self, record: StepRecord) -> None:  # an optional hook: empty on purpose
        pass

    def on_release(self, records: list[ReleaseInfo]) -> None:  # an optional hook: empty on purpose
        """Requests that ended outside a step (aborted between steps)."""

    def on_handoff(self, record: HandoffRecord) -> None:  # an optional hook: empty on purpose
        """A request moved (or tried to move) between replicas of a cluster."""


class Observes(Protocol):
    def on_arrival(self, record: ArrivalRecord) -> None: ...

    def on_step(self, record: StepRecord) -> None: ...

    def on_release(self, records: list[ReleaseInfo]) -> None: ...


@dataclass
class ObserverSet:
    """Fan a record out to every observer; one observer's bug is logged, never raised into the loop."""

    observers: list[Observes] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.observers)

    def add(self, observer: Observes) -> None:
        self.observers.append(observer)

    def arrival(self, record: ArrivalRecord) -> None:
        for observer in self.observers:
            _safely(observer, "on_arrival", record)

    def step(self, record: StepRecord) -> None:
        for observer in self.observers:
            _safely(observer, "on_step", record)

    def release(self, records: list[ReleaseInfo]) -> None:
        if records:
            for observer in self.observers:
                _safely(observer, "on_release", records)

    def handoff(self, record: HandoffRecord) -> None:
        for observer in self.observers:
            _safely(observer, "on_handoff", record)


def _safely(observer: object, hook: str, record: object) -> None:
    method = getattr(observer, hook, None)
    if method is None:
        return  # every hook is optional
    try:
        method(record)
    except Exception:  # an observer must never take the loop down
        logger.exception("observer %r failed in %s", observer, hook)
