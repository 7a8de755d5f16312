"""The update stage as users see it: engine-core token ids become `RequestOutput`s.

The front end keeps, per user request, one state per sample (n > 1 fans out into n engine requests):
the incremental detokenizer with its stop strings, the logprobs, and the lifecycle times stamped with
the core's step timestamps. Each core step's outputs become deltas; cumulative text and ids are built
only where asked (`SamplingParams.output_kind`), and request metrics only once, at the finish. A stop
string is text, so it is found here; the caller then finishes that request in the core.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from tokenloop.core.messages import CoreOutput, CoreOutputs, CoreRequest
from tokenloop.errors import InvalidRequestError
from tokenloop.logprobs import TokenLogprobs
from tokenloop.request import NS_PER_S, FinishReason, RequestTimes, SamplingParams, adapter_cache_salt
from tokenloop.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


def child_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed: the request's seed plus the index, kept inside torch's 64-bit seed range."""
    if seed is None:
        return None
    child = seed + index
    return child - 2 ** 64 if child >= 2 ** 64 else child


@dataclass
class CompletionOutput:
    """One sample of a request: cumulative text and tokens, plus what this step added."""

    index: int
    text: str
    token_ids: list[int]
    text_delta: str
    token_ids_delta: list[int]
    logprobs: list[TokenLogprobs] | None
    logprobs_delta: list[TokenLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why the engine failed it, when finish_reason is "error"
    error_param: str | None = None  # the request field to blame, when the failure is the request's own fault

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Lifecycle times (seconds on the engine clock) and the latencies derived from them."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    queue_wait_s: float | None
    ttft_s: float | None
    itls_s: list[float]
    tpot_s: float | None
    e2e_s: float | None
    prefill_s: float | None
    decode_s: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    num_preemptions: int

    @classmethod
    def from_times(cls, t: RequestTimes, num_prompt_tokens: int, num_generation_tokens: int,
                   num_cached_tokens: int, num_preemptions: int) -> RequestMetrics:
        def s(ns: int | float | None) -> float | None:
            return None if ns is None else ns / NS_PER_S

        return cls(
            arrival_time=t.arrival / NS_PER_S, first_scheduled_time=s(t.first_scheduled),
            first_token_time=s(t.first_token), last_token_time=s(t.last_token), finished_time=s(t.finished),
            queue_wait_s=s(t.queue_wait_ns), ttft_s=s(t.ttft_ns), itls_s=[x / NS_PER_S for x in t.itls_ns],
            tpot_s=s(t.tpot_ns), e2e_s=s(t.e2e_ns), prefill_s=s(t.prefill_ns), decode_s=s(t.decode_ns),
            num_prompt_tokens=num_prompt_tokens, num_generation_tokens=num_generation_tokens,
            num_cached_tokens=num_cached_tokens, num_preemptions=num_preemptions)


@dataclass
class RequestOutput:
    """What a step produced for one request (vLLM's shape): one CompletionOutput per sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None  # set on the finished output


@dataclass
class _Sample:
    """Front-end state of one sequence: its tokens, text, logprobs and times."""

    index: int
    core_id: str
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    times: RequestTimes
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    reported_tokens: int = 0
    reported_logprobs: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_param: str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class _Group:
    """A user request: n samples sharing one prompt (and, through the prefix cache, its blocks)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass
class ProcessedOutputs:
    """One core step seen by users, and the requests the front end ended that the core must now finish."""

    outputs: list[RequestOutput]
    stopped: list[tuple[str, str]]  # (core request id, stop string): finish these with "stop"
    failed: list[str] = field(default_factory=list)  # core request ids: the front end failed them


class OutputProcessor:
    """Turns core outputs into user outputs; owns every unfinished request's front-end state."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._groups: dict[str, _Group] = {}
        self._samples: dict[str, tuple[_Group, _Sample]] = {}  # core request id -> its group and sample

    # ---- requests in -----------------------------------------------------------------------------

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            arrival_ns: int, *, priority: int = 0, user: str | None = None,
            cache_salt: str | None = None, lora_name: str | None = None) -> list[CoreRequest]:
        """Register a user request; returns its core requests (one per sample) for the caller to submit.

        If submitting fails, call `forget(request_id)`.
        """
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        samples: list[_Sample] = []
        core_requests: list[CoreRequest] = []
        cache_salt = adapter_cache_salt(cache_salt, lora_name)
        for index in range(params.n):
            child_params = params
            if params.n > 1:  # each sample draws its own stream; a seed still makes the set reproducible
                child_params = dataclasses.replace(params, n=1, seed=child_seed(params.seed, index))
            core_id = request_id if params.n == 1 else f"{request_id}#{index}"
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=list(params.stop or []), include_stop_str_in_output=params.include_stop_str_in_output)
            wants_logprobs = params.logprobs is not None
            samples.append(_Sample(index, core_id, child_params, detokenizer, RequestTimes(arrival=arrival_ns),
                                   logprobs=[] if wants_logprobs else None,
                                   cumulative_logprob=0.0 if wants_logprobs else None))
            core_requests.append(CoreRequest(core_id, prompt_token_ids, child_params, arrival_ns, prompt,
                                             priority, user, cache_salt, lora_name=lora_name))
        group = _Group(request_id, prompt, prompt_token_ids, samples,
                       [None] if params.prompt_logprobs is not None else None)
        self._groups[request_id] = group
        for sample in samples:
            self._samples[sample.core_id] = (group, sample)
        return core_requests

    def forget(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is not None:
            for sample in group.samples:
                self._samples.pop(sample.core_id, None)

    def core_ids(self, request_id: str) -> list[str]:
        """The unfinished core requests of a user request (to abort them)."""
        group = self._groups.get(request_id)
        if group is None:
            return []
        return [s.core_id for s in group.samples if s.finish_reason is None]

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    def request_ids(self) -> list[str]:
        return list(self._groups)

    # ---- outputs ---------------------------------------------------------------------------------

    def process(self, core: CoreOutputs) -> ProcessedOutputs:
        """Apply one core step's outputs; returns the touched requests' outputs and new stop-string hits."""
        touched: dict[str, _Group] = {}
        stopped: list[tuple[str, str]] = []
        failed: list[str] = []
        now = core.timestamp_ns
        for out in core.outputs:
            entry = self._samples.get(out.request_id)
            if entry is None:
                continue  # finished here already (a stop string), or never known
            group, sample = entry
            if sample.finish_reason is not None:
                continue
            touched[group.request_id] = group
            try:
                stop = self._apply(group, sample, out, now)
            except Exception as exc:  # one request's failure must not take the others down
                logger.exception("processing the output of %s failed", sample.core_id)
                sample.finish_reason = FinishReason.ERROR
                sample.error = f"the server failed while detokenizing this request ({type(exc).__name__})"
                sample.times.finished = now
                if not out.finished:
                    failed.append(sample.core_id)
                continue
            if stop is not None:
                stopped.append((sample.core_id, stop))
        return ProcessedOutputs([self._make_output(group) for group in touched.values()], stopped, failed)

    def _apply(self, group: _Group, sample: _Sample, out: CoreOutput, now: int) -> str | None:
        """Fold one core output into the sample; returns the stop string if one just ended it."""
        params = sample.params
        # Every sample computes the whole prompt (prompt logprobs turn prefix hits off): take sample 0's.
        if out.new_prompt_logprobs is not None and group.prompt_logprobs is not None and sample.index == 0:
            group.prompt_logprobs.extend(out.new_prompt_logprobs)
        stop_string = None
        for i, token in enumerate(out.new_token_ids):
            sample.token_ids.append(token)
            sample.times.record_token(now)
            if sample.logprobs is not None and out.new_logprobs is not None and i < len(out.new_logprobs):
                lp = out.new_logprobs[i]
                sample.logprobs.append(lp)
                sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + lp.logprob
            update = sample.detokenizer.update([token], check_stop=len(sample.token_ids) >= params.min_tokens)
            if update.stop_string is not None:
                stop_string = update.stop_string
                break  # text after a stop string is never emitted; neither are its tokens' successors
        if stop_string is not None:
            # EOS or a stop token on the same token ranks first (vLLM's order); one further on (a speculative
            # step appends several tokens) comes after the stop string and never happened.
            if out.finish_reason == FinishReason.STOP and i == len(out.new_token_ids) - 1:
                self._finish(sample, out, now)
                return None
            sample.finish_reason, sample.stop_reason = FinishReason.STOP, stop_string
            sample.times.finished = now
            self._finish_numbers(sample, out)
            return stop_string if not out.finished else None
        if out.new_token_ids or out.finished:
            self._finish_numbers(sample, out)
        if out.finished:
            if out.finish_reason != FinishReason.ABORT:  # a cancelled request's held-back text stays unsent
                sample.detokenizer.finish()
            self._finish(sample, out, now)
        return None

    def _finish(self, sample: _Sample, out: CoreOutput, now: int) -> None:
        sample.finish_reason, sample.stop_reason, sample.error = out.finish_reason, out.stop_reason, out.error
        sample.error_param = out.error_param
        if sample.times.finished is None:
            sample.times.finished = now
        self._finish_numbers(sample, out)

    @staticmethod
    def _finish_numbers(sample: _Sample, out: CoreOutput) -> None:
        sample.times.first_scheduled = out.first_scheduled_ns
        sample.num_cached_tokens = out.num_cached_tokens
        sample.num_preemptions = out.num_preemptions

    def _make_output(self, group: _Group) -> RequestOutput:
        completions = []
        for sample in group.samples:
            tokens = sample.token_ids
            token_ids_delta = tokens[sample.reported_tokens:]
            text_delta = sample.detokenizer.take_new_text()
            logprobs_delta = None
            if sample.logprobs is not None:
                logprobs_delta = sample.logprobs[sample.reported_logprobs:]
                sample.reported_logprobs = len(sample.logprobs)
            kind = sample.params.output_kind
            finished = sample.finish_reason is not None
            if kind == "cumulative" or (kind == "final" and finished):
                text, token_ids, logprobs = sample.detokenizer.output_text, list(tokens), sample.logprobs
            else:  # nothing that grows with the output's length
                text, token_ids, logprobs = text_delta, token_ids_delta, logprobs_delta
            completions.append(CompletionOutput(
                index=sample.index, text=text, token_ids=token_ids, text_delta=text_delta,
                token_ids_delta=token_ids_delta, logprobs=logprobs, logprobs_delta=logprobs_delta,
                cumulative_logprob=sample.cumulative_logprob, finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason, error=sample.error, error_param=sample.error_param))
            sample.reported_tokens = len(tokens)
        metrics = None
        finished = group.finished
        if finished:
            first = group.samples[0]
            metrics = RequestMetrics.from_times(first.times, len(group.prompt_token_ids), len(first.token_ids),
                                                first.num_cached_tokens, first.num_preemptions)
            self.forget(group.request_id)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, group.prompt_logprobs,
                             completions, finished, metrics)
