"""A request's identity, settings, lifecycle state and timestamps.

Times are integer nanoseconds from one injectable monotonic clock, so derived latencies add up
exactly: e2e == ttft + sum(itls) holds to the nanosecond, not merely within float rounding.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenloop.errors import InvalidRequestError
from tokenloop.structured.spec import StructuredOutputsParams

if TYPE_CHECKING:  # torch is imported where a generator is made: sampling parameters, a request's
    # description, travel to processes (the server's front end) that never import torch otherwise
    import torch

    from tokenloop.core.ngram import NgramIndex
    from tokenloop.structured.matcher import RequestMatcher

Clock = Callable[[], int]
"""A monotonic clock returning integer nanoseconds (default: `time.monotonic_ns`)."""

NS_PER_S = 1_000_000_000
# Below this, dividing by the temperature overflows float32; such rows are greedy, as in vLLM.
GREEDY_TEMPERATURE = 1e-5


def default_clock() -> int:
    return time.monotonic_ns()


@dataclass(frozen=True)
class LoRARequest:
    """Run a request with a LoRA adapter (vLLM's LoRARequest): by name, loaded from `lora_path` if the engine
    does not serve that name yet (offline `LLM` only; a server loads adapters at start or by its route)."""

    lora_name: str
    lora_int_id: int = 0  # vLLM's numeric id: accepted for compatibility, the name identifies the adapter
    lora_path: str | None = None


def adapter_cache_salt(cache_salt: str | None, lora_name: str | None) -> str | None:
    """The salt a request's blocks are hashed with: its own, and its LoRA adapter's name, so a prefix hit
    never crosses adapters (the same tokens under another adapter have other K/V). Applied once, where a
    request enters the engine, so the router, handoffs and KV events all see the same hashes."""
    if lora_name is None:
        return cache_salt
    return f"{cache_salt or ''}\x00lora:{lora_name}"


class RequestStatus(enum.StrEnum):
    """Where a request is in its life (the loop's words); equal to its value, so records travel as it."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    EXPORTING = "exporting"  # paused for a handoff: keeps its blocks, skipped by the scheduler
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"
    HANDED_OFF = "handed_off"  # lives on in another engine under the same id: over here, not for its user

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The OpenAI-style finish reason of a finished status (None for handed off or unfinished)."""
        return _FINISH_REASONS.get(self)


class FinishReason(enum.StrEnum):
    """Why a request ended, in OpenAI's words; equal to those strings, so it travels and prints as them."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    @property
    def status(self) -> RequestStatus:
        """The status a request ends with for this reason."""
        return _FINISH_STATUS[self]


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR,
                       RequestStatus.HANDED_OFF})
_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
                   RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
                   RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
                   RequestStatus.FINISHED_ERROR: FinishReason.ERROR}
_FINISH_STATUS = {reason: status for status, reason in _FINISH_REASONS.items()}


OUTPUT_KINDS = ("final", "delta", "cumulative")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; field names and defaults follow vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # What `text`, `token_ids` and `logprobs` of an output hold (the `*_delta` fields always hold this step's
    # part): "final" (default): this step's part, and everything on the finished output; "delta": this
    # step's part, always; "cumulative": everything so far, every step (O(length) per step: a long stream
    # costs O(length^2)). After vLLM's RequestOutputKind.
    output_kind: str = "final"
    structured_outputs: StructuredOutputsParams | None = None  # json / regex / choice / grammar constraint

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value}", param=name)
        if self.logit_bias and not all(math.isfinite(v) for v in self.logit_bias.values()):
            raise InvalidRequestError("logit_bias values must be finite numbers", param="logit_bias")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 or 0 (disabled) or positive, got {self.top_k}",
                                      param="top_k")
        self.top_k = max(self.top_k, 0)
        # Messages are str.format templates, filled in only for a check that fails: a request's params are
        # built once per request, and formatting all of them every time cost more than the checks.
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", "n must be >= 1, got {self.n}"),
            (self.temperature >= 0, "temperature", "temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty",
             "presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             "frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, "repetition_penalty",
             "repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             "max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
             "logprobs must be in [0, 20], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             "prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings"),
            (self.output_kind in OUTPUT_KINDS, "output_kind",
             "output_kind must be one of " + ", ".join(OUTPUT_KINDS) + ", got {self.output_kind!r}"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message.format(self=self), param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RequestTimes:
    """Lifecycle timestamps (ns) and the latencies derived from them."""

    arrival: int
    first_scheduled: int | None = None
    first_token: int | None = None
    token_times: list[int] = field(default_factory=list)
    finished: int | None = None

    def record_token(self, now: int) -> None:
        if self.first_token is None:
            self.first_token = now
        self.token_times.append(now)

    @property
    def last_token(self) -> int | None:
        return self.token_times[-1] if self.token_times else None

    @property
    def queue_wait_ns(self) -> int | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft_ns(self) -> int | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itls_ns(self) -> list[int]:
        times = self.token_times
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def tpot_ns(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e_ns(self) -> int | None:
        """Arrival to the last token (or to the end, for a request that produced none)."""
        end = self.last_token if self.last_token is not None else self.finished
        return None if end is None else end - self.arrival

    @property
    def prefill_ns(self) -> int | None:
        if self.first_scheduled is None or self.first_token is None:
            return None
        return self.first_token - self.first_scheduled

    @property
    def decode_ns(self) -> int | None:
        if self.first_token is None:
            return None
        return self.token_times[-1] - self.first_token


class Request:
    """One sequence going around the serving loop.

    `all_token_ids` is prompt + output; `num_computed_tokens` counts the tokens whose K/V are in the
    cache. Every step the scheduler gives the request some tokens so it catches up towards
    `num_tokens`; when it is caught up, the step samples one new token.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        arrival_ns: int,
        *,
        prompt: str | None = None,
        priority: int = 0,
        user: str | None = None,
        cache_salt: str | None = None,
        eos_token_ids: Collection[int] = (),
        lora_name: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: at least one token is needed", param="prompt")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.user = user
        self.cache_salt = cache_salt  # with the adapter folded in (`adapter_cache_salt`): hits stay within it
        self.lora_name = lora_name  # the LoRA adapter it runs with; None: the base model
        self.eos_token_ids = frozenset(eos_token_ids)  # any of them ends the request (unless ignore_eos)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.error_param: str | None = None  # the field to blame when the error is the request's own fault
        self.times = RequestTimes(arrival=arrival_ns)
        # Chained hashes of this request's full blocks, filled in lazily by the KV cache manager.
        self.block_hashes: list[int] = []
        # The n-gram lookup index of speculative decoding, filled in lazily by its proposer.
        self.ngram_index: NgramIndex | None = None
        # A seeded request draws from its own generator so that batching does not change its output.
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            import torch

            self.generator = torch.Generator()
            self.generator.manual_seed(sampling_params.seed)
        # A constrained request's grammar state, set by the engine; it advances with new output tokens only.
        self.structured: RequestMatcher | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
