"""What crosses the boundary between the front end and the engine core: small dataclasses, plain fields.

The core takes token ids in and gives token ids (+ logprobs) out. The same classes travel in-process (the
offline `LLM`, tests) and over a socket (the server's engine process); `tokenloop.core.wire` turns them
into msgpack and back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenloop.core.kv_events import KVEventBatch
from tokenloop.logprobs import TokenLogprobs
from tokenloop.observe.records import ArrivalRecord, HandoffRecord, ReleaseInfo, StepRecord
from tokenloop.request import FinishReason, SamplingParams


@dataclass(slots=True)
class CoreRequest:
    """Add one sequence (one sample: the front end fans n > 1 out into n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # n == 1; stop strings are the front end's, the core ignores them
    arrival_ns: int
    prompt: str | None = None  # only for traces
    priority: int = 0
    user: str | None = None
    cache_salt: str | None = None
    # A failover's recompute of a constrained request: the output tokens it produced elsewhere (now the
    # prompt's tail), which its new matcher accepts first so the grammar goes on from where it was.
    structured_replay: list[int] | None = None
    lora_name: str | None = None  # the LoRA adapter to run with (its name is already in `cache_salt`)


@dataclass(slots=True)
class CoreOutput:
    """What one step did for one request: its new tokens, and how it ended if it did."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None  # the next piece, from prompt position 1 on
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it
    error: str | None = None
    # The request's own counters (three ints: cheaper than a second message at the end).
    first_scheduled_ns: int | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # When `error` is the request's own fault (its constraint hit the grammar compiler's limits mid-way):
    # the request field to blame, so the client gets a 4xx naming it, not a 500.
    error_param: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class CoreOutputs:
    """One step's outputs, sent as one batch; `timestamp_ns` stamps every token it carries."""

    outputs: list[CoreOutput]
    timestamp_ns: int
    num_scheduled: int  # 0: nothing could run this step
    record: StepRecord | None = None
    arrivals: list[ArrivalRecord] = field(default_factory=list)  # for observers in the front end
    releases: list[ReleaseInfo] = field(default_factory=list)  # ended outside a step (aborts)
    kv_events: KVEventBatch | None = None  # what the step did to the prefix index (when enabled)
    handoffs: list[HandoffRecord] = field(default_factory=list)  # a cluster's front door adds these


# ---- the engine-core protocol: what the front end sends, and what the core answers -----------------------

@dataclass(slots=True)
class AddRequests:
    """Queue requests all or none; answered by the `CallResult` with the same `call_id`."""

    call_id: int
    requests: list[CoreRequest]


@dataclass(slots=True)
class FinishRequests:
    """End requests now (abort, a stop string found by the front end, an error it hit); never answered:
    their final outputs come in the next frame."""

    request_ids: list[str]
    finish_reason: FinishReason = FinishReason.ABORT
    stop_reason: int | str | None = None


@dataclass(slots=True)
class UtilityCall:
    """Run one of the core's named utilities between steps (`tokenloop.core.core_loop.UTILITIES`)."""

    call_id: int
    name: str
    args: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class Shutdown:
    """Abort everything and exit."""


@dataclass(slots=True)
class CoreError:
    """An exception raised in the core, as data: the front end raises the same class again."""

    kind: str  # the exception class name (InvalidRequestError, CapacityError, ...)
    message: str
    param: str | None = None
    retry_after_s: float | None = None


@dataclass(slots=True)
class CallResult:
    """The answer to an `AddRequests` (value None) or a `UtilityCall`."""

    call_id: int
    value: Any = None
    error: CoreError | None = None


@dataclass(slots=True)
class CoreReady:
    """The core is built and listening: the facts the front end needs before it serves anyone."""

    pid: int
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    dtype: str  # DtypeChoice.describe()
    error: CoreError | None = None  # set instead when building the core failed


@dataclass(slots=True)
class CoreFrame:
    """What one turn of the core's loop produced: at most one step's outputs (with the observer records
    since the last frame: queue and pool gauges travel in them) and the answers to the calls it applied."""

    outputs: CoreOutputs | None
    results: list[CallResult] = field(default_factory=list)


@dataclass(slots=True)
class CoreHeartbeat:
    """Sent by the core's heartbeat thread every fraction of a second: how far its main thread has got
    (`tokenloop.core.heartbeat`); a counter that stops moving means a hung core."""

    progress: int


InputMessage = AddRequests | FinishRequests | UtilityCall | Shutdown
