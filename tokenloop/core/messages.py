"""What crosses the boundary between the front end and the engine core: small dataclasses, plain fields.

The core takes token ids in and gives token ids (+ logprobs) out. The same classes travel in-process (the
offline `LLM`, tests) and over a socket (the server's engine process); `tokenloop.core.wire` turns them
into msgpack and back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloop.core.kv_events import KVEventBatch
from tokenloop.observe.records import ArrivalRecord, ReleaseInfo, StepRecord
from tokenloop.request import SamplingParams
from tokenloop.sampler import TokenLogprobs


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


@dataclass(slots=True)
class CoreOutput:
    """What one step did for one request: its new tokens, and how it ended if it did."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None  # the next piece, from prompt position 1 on
    finish_reason: str | None = None  # stop, length, abort, error
    stop_reason: int | str | None = None  # the stop token id that ended it
    error: str | None = None
    # The request's own counters (three ints: cheaper than a second message at the end).
    first_scheduled_ns: int | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

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
