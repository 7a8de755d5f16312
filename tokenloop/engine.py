"""LLMEngine: the serving loop itself.

One `step()` goes once around the loop: schedule -> KV allocate/reuse (inside the scheduler) ->
execute -> sample -> update (append, stop checks) -> release the finished. Unfinished requests simply
stay with the scheduler for the next step.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from tokenloop.config import EngineConfig
from tokenloop.core.kv_cache import KVCacheManager
from tokenloop.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput, SchedulerStats
from tokenloop.errors import InvalidRequestError
from tokenloop.model.dtypes import CpuFeatures, build_model, resolve_dtype
from tokenloop.model.loader import Checkpoint, load_checkpoint
from tokenloop.request import NS_PER_S, Clock, Request, RequestStatus, SamplingParams, default_clock
from tokenloop.runner import ModelRunner, RunnerOutput
from tokenloop.sampler import Sampler, TokenLogprobs
from tokenloop.structured.engine_hooks import StructuredOutputs
from tokenloop.tokenizer import IncrementalDetokenizer, Tokenizer
from tokenloop.tracing import Tracer

logger = logging.getLogger(__name__)


def _child_seed(seed: int | None, index: int) -> int | None:
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
    finish_reason: str | None = None  # stop, length, abort or error
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why the engine failed it, when finish_reason is "error"

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
    def of(cls, request: Request) -> RequestMetrics:
        t = request.times

        def s(ns: int | float | None) -> float | None:
            return None if ns is None else ns / NS_PER_S

        return cls(
            arrival_time=t.arrival / NS_PER_S, first_scheduled_time=s(t.first_scheduled),
            first_token_time=s(t.first_token), last_token_time=s(t.last_token), finished_time=s(t.finished),
            queue_wait_s=s(t.queue_wait_ns), ttft_s=s(t.ttft_ns), itls_s=[x / NS_PER_S for x in t.itls_ns],
            tpot_s=s(t.tpot_ns), e2e_s=s(t.e2e_ns), prefill_s=s(t.prefill_ns), decode_s=s(t.decode_ns),
            num_prompt_tokens=request.num_prompt_tokens, num_generation_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens, num_preemptions=request.num_preemptions)


@dataclass
class RequestOutput:
    """What a step produced for one request (vLLM's shape): one CompletionOutput per sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None


@dataclass
class StepStats:
    """Where one step's time went, for overhead accounting and tracing."""

    num_scheduled: int = 0
    num_batched_tokens: int = 0
    num_preempted: int = 0
    schedule_s: float = 0.0
    execute_s: float = 0.0  # batch building + forward
    forward_s: float = 0.0  # the model forward alone
    sample_s: float = 0.0
    update_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.execute_s + self.sample_s + self.update_s

    @property
    def overhead_s(self) -> float:
        """Everything but the model forward: scheduling, batch building, sampling, updates."""
        return self.total_s - self.forward_s


@dataclass
class _Sample:
    """Engine-side state of one sequence: its scheduler request and its streaming decoder."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None
    cumulative_logprob: float | None
    reported_tokens: int = 0
    reported_logprobs: int = 0


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
        return all(s.request.is_finished for s in self.samples)


class LLMEngine:
    """The serving loop over one model: `add_request`, `abort_request`, `step`."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None,
                 clock: Clock = default_clock, tracer: Tracer | None = None) -> None:
        self.config = config
        self.clock = clock
        self.tracer = tracer  # None: nothing is traced (see tokenloop.tracing)
        checkpoint = checkpoint or load_checkpoint(config.model, keep_quantized=True)
        self.checkpoint = checkpoint
        self.tokenizer: Tokenizer = checkpoint.tokenizer
        model_config = checkpoint.config
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.dtype_choice = resolve_dtype(config.dtype, config.weight_dtype, config.device,
                                          checkpoint.is_quantized, CpuFeatures.detect())
        logger.info("dtype: %s", self.dtype_choice.describe())
        self.model = build_model(model_config, checkpoint.weights, self.dtype_choice, config.device,
                                 self.max_model_len)
        block_size = config.cache.block_size
        num_blocks = config.cache.num_blocks or max(
            1, config.cache.kv_cache_memory_bytes // self.model.kv_bytes_per_block(block_size))
        if num_blocks * block_size < self.max_model_len:
            # A request may grow to max_model_len; a pool smaller than that could never hold it alone.
            logger.info("max_model_len %d exceeds the KV cache (%d tokens); lowering it to fit",
                           self.max_model_len, num_blocks * block_size)
            self.max_model_len = num_blocks * block_size
        if tracer is None:
            self.kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        else:  # the same manager, also timing its verbs: the loop's KV stage
            self.kv_cache = tracer.kv_cache_manager(num_blocks, block_size, config.cache.enable_prefix_caching, clock)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len, clock)
        self.runner = ModelRunner(self.model, num_blocks, block_size)
        self.sampler = Sampler(model_config.vocab_size, seed=config.seed)
        self.structured = StructuredOutputs(self.tokenizer, model_config.vocab_size)  # grammars, built lazily
        self._groups: dict[str, _Group] = {}
        self._samples: dict[str, tuple[_Group, _Sample]] = {}  # scheduler request id -> its group and sample
        self._request_counter = itertools.count()
        self.last_step = StepStats()
        self.num_steps = 0
        if tracer is not None:
            tracer.attach(self, self.kv_cache)

    # ---- requests in -----------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | Sequence[int] | None, prompt_token_ids: Sequence[int] | None) -> list[int]:
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif prompt is not None:
            ids = list(prompt)
        else:
            raise InvalidRequestError("a prompt (text or token ids) is required", param="prompt")
        vocab = self.checkpoint.config.vocab_size
        for token in ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                raise InvalidRequestError(f"prompt token {token!r} is not a token id in [0, {vocab})",
                                          param="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty: at least one token is needed", param="prompt")
        return ids

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int] | None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        priority: int = 0,
        user: str | None = None,
        cache_salt: str | None = None,
        arrival_ns: int | None = None,
    ) -> str:
        """Queue a request (text or token ids). Returns its id. Raises InvalidRequestError / CapacityError."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._request_counter)}"
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        ids = self._prompt_ids(prompt, prompt_token_ids)
        self.sampler.validate(params)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max(1, self.max_model_len - len(ids)))
        arrival = self.clock() if arrival_ns is None else arrival_ns
        text = prompt if isinstance(prompt, str) else None
        grammar = self.structured.compile(params.structured_outputs)  # None when unconstrained
        samples: list[_Sample] = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:  # each sample draws its own stream; a seed still makes the set reproducible
                child_params = dataclasses.replace(params, n=1, seed=_child_seed(params.seed, index))
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            request = Request(child_id, ids, child_params, arrival, prompt=text, priority=priority, user=user,
                              cache_salt=cache_salt, eos_token_id=self.tokenizer.eos_token_id)
            request.structured = grammar.new_matcher() if grammar is not None else None  # one per sample
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens, stop=list(params.stop or []),
                include_stop_str_in_output=params.include_stop_str_in_output)
            wants_logprobs = params.logprobs is not None
            samples.append(_Sample(index, request, detokenizer, [] if wants_logprobs else None,
                                   0.0 if wants_logprobs else None))
        added: list[Request] = []
        try:
            for sample in samples:
                self.scheduler.add_request(sample.request)
                added.append(sample.request)
        except Exception:
            for request in added:  # all samples or none
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
            raise
        group = _Group(request_id, text, ids, samples, [None] if params.prompt_logprobs is not None else None)
        self._groups[request_id] = group
        for sample in samples:
            self._samples[sample.request.request_id] = (group, sample)
        if self.tracer is not None and self.tracer.enabled:
            for sample in samples:
                self.tracer.on_arrival(sample.request)
        return request_id

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Cancel requests: their block references are released now and no step produces anything more
        for them. Returns each one's final output (finish_reason "abort", with its metrics)."""
        finals = []
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.get(request_id)
            if group is None:
                continue
            now = self.clock()
            for sample in group.samples:
                if sample.request.times.finished is None:
                    sample.request.times.finished = now
                self._finish(sample.request.request_id, RequestStatus.FINISHED_ABORTED)
            finals.append(self._make_output(group))
        return finals

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # ---- one step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Go around the loop once; return the outputs of every request that progressed or ended."""
        stats = StepStats()
        tracer = self.tracer if self.tracer is not None and self.tracer.enabled else None
        step_start = tracer.begin_step() if tracer is not None else 0
        begin = time.perf_counter()
        schedule = self.scheduler.schedule()
        stats.schedule_s = time.perf_counter() - begin
        stats.num_scheduled = len(schedule.scheduled)
        stats.num_batched_tokens = schedule.num_batched_tokens
        stats.num_preempted = len(schedule.preempted)
        self.last_step = stats
        touched: dict[str, _Group] = {}
        for request in schedule.failed:  # failed while being scheduled: they end now, alone
            self._record_failure(request, touched)
        if schedule.is_empty:
            if tracer is not None and schedule.preempted:  # nothing ran, but preemptions are transitions
                now = tracer.end_schedule()
                tracer.end_step(schedule, step_start, now, now, now, 0.0, [], [])
            return [self._make_output(group) for group in touched.values()]
        self.num_steps += 1
        schedule_end = tracer.end_schedule() if tracer is not None else 0

        begin = time.perf_counter()
        schedule, result = self._execute_isolated(schedule, touched)
        stats.execute_s = time.perf_counter() - begin
        execute_end = self.clock() if tracer is not None else 0
        if result is None:  # every request of the batch failed
            return [self._make_output(group) for group in touched.values()]
        stats.forward_s = result.forward_s
        self.scheduler.update_from_output(schedule)

        begin = time.perf_counter()
        sampling = [schedule.scheduled[i].request for i in result.sample_indices]
        sampled = self._sample_isolated(result.logits, sampling, touched) if sampling else []
        stats.sample_s = time.perf_counter() - begin

        begin = time.perf_counter()
        self._record_prompt_logprobs(result)
        now = self.clock()
        for request, token, logprobs in sampled:
            group, sample = self._samples[request.request_id]
            try:
                self._update(sample, token, logprobs, now)
            except Exception:  # noqa: BLE001 - one request's failure must not take the others down
                logger.exception("update of %s failed", request.request_id)
                self._fail_request(request, "updating")
            touched[group.request_id] = group
        outputs = [self._make_output(group) for group in touched.values()]
        stats.update_s = time.perf_counter() - begin
        if tracer is not None:
            tracer.end_step(schedule, step_start, schedule_end, execute_end, now, stats.forward_s,
                            [r for r, _, _ in sampled], [t for _, t, _ in sampled])
        return outputs

    # ---- fault isolation: a stage that raises for one request fails that request alone ------------

    def _execute_isolated(self, schedule: SchedulerOutput, touched: dict[str, _Group],
                          ) -> tuple[SchedulerOutput, RunnerOutput | None]:
        """One forward over the batch; if it raises, find the requests it fails for and rerun without them.

        Rerunning is safe: a forward only writes the K/V of its own slots, and writes the same values again.
        """
        try:
            self.runner.apply_block_diffs(schedule)
            return schedule, self.runner.execute(schedule)
        except Exception as exc:  # noqa: BLE001 - isolate below
            logger.exception("model forward failed for a batch of %d request(s)", len(schedule.scheduled))
            first_error = exc
        items = schedule.scheduled
        middle = len(items) // 2
        failing = (self._failing_items(schedule, items[:middle]) + self._failing_items(schedule, items[middle:])
                   if len(items) > 1 else [(items[0], first_error)])
        for item, cause in failing:
            self._record_failure(item.request, touched, "running the model on", cause)
        failed = {id(item) for item, _ in failing}
        survivors = [item for item in items if id(item) not in failed]
        if not survivors:
            return schedule, None
        rest = self._sub_schedule(schedule, survivors)
        try:
            return rest, self.runner.execute(rest)
        except Exception as exc:  # noqa: BLE001 - fails only together: give up on all of them
            logger.exception("model forward failed again for the remaining batch")
            for item in survivors:
                self._record_failure(item.request, touched, "running the model on", exc)
            return rest, None

    def _failing_items(self, schedule: SchedulerOutput, items: list[ScheduledRequest],
                       ) -> list[tuple[ScheduledRequest, BaseException]]:
        """The items whose forward fails, by bisection: one culprit in B costs ~2 log2(B) smaller forwards."""
        if not items:
            return []
        try:
            self.runner.execute(self._sub_schedule(schedule, items))
            return []
        except Exception as exc:  # noqa: BLE001 - narrowed down below
            if len(items) == 1:
                logger.exception("model forward failed for request %s", items[0].request_id)
                return [(items[0], exc)]
        middle = len(items) // 2
        return self._failing_items(schedule, items[:middle]) + self._failing_items(schedule, items[middle:])

    @staticmethod
    def _sub_schedule(schedule: SchedulerOutput, items: list[ScheduledRequest]) -> SchedulerOutput:
        return dataclasses.replace(schedule, scheduled=items, num_batched_tokens=sum(i.num_tokens for i in items))

    def _sample_isolated(self, logits: torch.Tensor, requests: list[Request], touched: dict[str, _Group],
                         ) -> list[tuple[Request, int, TokenLogprobs | None]]:
        """Sample every row at once; if that raises, row by row, failing only the rows that raise."""
        try:
            out = self.sampler.sample(logits, requests)
            return list(zip(requests, out.token_ids, out.logprobs))
        except Exception:  # noqa: BLE001 - isolate below
            logger.exception("sampling failed for a batch of %d request(s)", len(requests))
        sampled = []
        for row, request in enumerate(requests):
            try:
                out = self.sampler.sample(logits[row:row + 1], [request])
            except Exception:  # noqa: BLE001 - this row's sampling fails: it ends with an error
                logger.exception("sampling failed for request %s", request.request_id)
                self._record_failure(request, touched, "sampling")
                continue
            sampled.append((request, out.token_ids[0], out.logprobs[0]))
        return sampled

    def _record_failure(self, request: Request, touched: dict[str, _Group], stage: str | None = None,
                        cause: BaseException | None = None) -> None:
        """Fail `request` (unless the scheduler already did) and mark its group for an output this step."""
        entry = self._samples.get(request.request_id)
        if stage is not None:
            self._fail_request(request, stage, cause)
        elif self.tracer is not None and self.tracer.enabled:
            now = self.clock()
            self.tracer.on_release(request, [], now, now)
        if entry is not None:
            touched[entry[0].request_id] = entry[0]

    def _fail_request(self, request: Request, stage: str, cause: BaseException | None = None) -> None:
        # The exception is this request's own (isolated above): its text may help an offline caller.
        cause = cause if cause is not None else sys.exc_info()[1]
        detail = f" ({type(cause).__name__}: {str(cause)[:200]})" if cause is not None else ""
        request.error = f"the server failed while {stage} this request{detail}"
        if request.times.finished is None:
            request.times.finished = self.clock()
        self._finish(request.request_id, RequestStatus.FINISHED_ERROR)

    def _finish(self, request_id: str, status: RequestStatus) -> None:
        """End a request and release its block references; the tracer, if on, records what was released."""
        tracer = self.tracer
        if tracer is None or not tracer.enabled:
            self.scheduler.finish_request(request_id, status)
            return
        blocks = self.kv_cache.get_blocks(request_id)
        begin = self.clock()
        request = self.scheduler.finish_request(request_id, status)
        if request is not None:
            tracer.on_release(request, blocks, begin, self.clock())

    def _forget(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        for sample in group.samples:
            self._samples.pop(sample.request.request_id, None)

    def _record_prompt_logprobs(self, result: RunnerOutput) -> None:
        for piece in result.prompt_logits:
            group, _ = self._samples[piece.request_id]
            if group.prompt_logprobs is None:
                continue
            if len(group.prompt_logprobs) != piece.first_target:
                continue  # recomputed after a preemption, or another sample of the group: already recorded
            request = group.samples[0].request
            targets = torch.tensor(group.prompt_token_ids[piece.first_target:piece.first_target
                                                          + piece.logits.shape[0]])
            group.prompt_logprobs.extend(self.sampler.prompt_logprobs(
                piece.logits, targets, request.sampling_params.prompt_logprobs or 0))

    def _update(self, sample: _Sample, token: int, logprobs: TokenLogprobs | None, now: int) -> None:
        """Append the token, stamp it, detokenize, and run the stop checks in vLLM's order."""
        request = sample.request
        params = request.sampling_params
        request.append_output_token(token)
        request.times.record_token(now)
        self.structured.accept(request, token)  # raises if the grammar refuses it: fails this request only
        if sample.logprobs is not None and logprobs is not None:
            sample.logprobs.append(logprobs)
            sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + logprobs.logprob
        can_stop = request.num_output_tokens >= params.min_tokens
        update = sample.detokenizer.update([token], check_stop=can_stop)

        status: RequestStatus | None = None
        if can_stop and not params.ignore_eos and token == request.eos_token_id:
            status = RequestStatus.FINISHED_STOPPED
        elif request.structured is not None and request.structured.is_terminated:  # the grammar is complete
            status = RequestStatus.FINISHED_STOPPED
        elif can_stop and token in (params.stop_token_ids or ()):
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif update.stop_string is not None:
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, update.stop_string
        elif request.num_output_tokens >= (params.max_tokens or self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        elif request.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            if update.stop_string is None:
                sample.detokenizer.finish()
            request.times.finished = now
            self._finish(request.request_id, status)

    def _make_output(self, group: _Group) -> RequestOutput:
        completions = []
        for sample in group.samples:
            request = sample.request
            tokens = request.output_token_ids
            token_ids_delta = tokens[sample.reported_tokens:]
            text_delta = sample.detokenizer.take_new_text()
            logprobs_delta = None
            if sample.logprobs is not None:
                logprobs_delta = sample.logprobs[sample.reported_logprobs:]
                sample.reported_logprobs = len(sample.logprobs)
            kind = request.sampling_params.output_kind
            if kind == "cumulative" or (kind == "final" and request.is_finished):
                text, token_ids, logprobs = sample.detokenizer.output_text, list(tokens), sample.logprobs
            else:  # nothing that grows with the output's length
                text, token_ids, logprobs = text_delta, token_ids_delta, logprobs_delta
            completions.append(CompletionOutput(
                index=sample.index, text=text, token_ids=token_ids, text_delta=text_delta,
                token_ids_delta=token_ids_delta, logprobs=logprobs,
                logprobs_delta=logprobs_delta, cumulative_logprob=sample.cumulative_logprob,
                finish_reason=request.finish_reason, stop_reason=request.stop_reason, error=request.error))
            sample.reported_tokens = len(tokens)
        finished = group.finished
        if finished:
            self._forget(group)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, group.prompt_logprobs,
                             completions, finished, RequestMetrics.of(group.samples[0].request))
