"""EngineCore: the serving loop over one model, token ids in and token ids out.

One `step()` goes once around the loop:

    schedule -> execute -> sample -> update -> release -> record

Scheduling includes the KV stage (prefix hits, allocation, preemption); the update appends each sampled
token and stops a request by EOS, stop token ids, its grammar or its length (stop strings are text: the
front end finds them and finishes the request here). Each step ends with one `StepRecord` handed to the
observers; nothing they do reaches back into the loop. The same class runs in-process (the offline `LLM`)
and inside the server's engine process.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from tokenloop.config import EngineConfig
from tokenloop.core.handoff import HandoffStage, ImportResult, KVBlockData, KVSnapshot
from tokenloop.core.heartbeat import Progress
from tokenloop.core.isolation import Failure, Sampled, execute_isolated, sample_isolated
from tokenloop.core.kv_cache import KVCacheManager
from tokenloop.core.kv_events import KVEventBatch, KVEventLog, KVIndexSnapshot
from tokenloop.core.messages import CoreOutput, CoreOutputs, CoreRequest
from tokenloop.core.recording import gauges, release_infos, step_record
from tokenloop.core.scheduler import ScheduledRequest, Scheduler, SchedulerStats
from tokenloop.core.speculative import NgramProposer, accept_greedy
from tokenloop.errors import ConfigError, InvalidRequestError
from tokenloop.model.dtypes import CpuFeatures, build_model, require_device, resolve_dtype
from tokenloop.model.loader import Checkpoint, load_checkpoint
from tokenloop.observe.records import ArrivalRecord, ObserverSet, Observes
from tokenloop.request import Clock, Request, RequestStatus, default_clock
from tokenloop.runner import ModelRunner, RunnerOutput
from tokenloop.logprobs import TokenLogprobs
from tokenloop.sampler import Sampler
from tokenloop.structured.engine_hooks import StructuredOutputs

logger = logging.getLogger(__name__)

_FINISH_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH,
                  "abort": RequestStatus.FINISHED_ABORTED, "error": RequestStatus.FINISHED_ERROR}


class ModelStandIn(Protocol):
    """What stands in for the model when the core runs without one (the simulator, tokenloop.sim)."""

    vocab_size: int
    eos_token_id: int | None
    max_model_len: int

    def kv_bytes_per_block(self, block_size: int) -> int: ...

    def make_runner(self, num_blocks: int, block_size: int) -> ModelRunner: ...


class EngineCore:
    """Scheduler, KV cache, runner and sampler for one model: `add_request`, `finish_requests`, `step`."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None,
                 clock: Clock = default_clock, observers: Sequence[Observes] = (),
                 stand_in: ModelStandIn | None = None) -> None:
        self.config = config
        self.clock = clock
        self.observers = ObserverSet(list(observers))
        block_size = config.cache.block_size
        if stand_in is None:
            require_device(config.device)
            checkpoint = checkpoint or load_checkpoint(config.model, keep_quantized=True)
            model_config = checkpoint.config
            tokenizer = checkpoint.tokenizer
            # Every end-of-generation id stops a request: eos, and eot / generation_config's others
            # (Gemma's <end_of_turn>, Llama 3's <|eot_id|>).
            self.vocab_size, self.eos_token_ids = model_config.vocab_size, tokenizer.eos_token_ids
            model_len = model_config.max_position_embeddings
            self.dtype_choice = resolve_dtype(config.dtype, config.weight_dtype, config.device,
                                              checkpoint.is_quantized, CpuFeatures.detect(), config.kv_cache_dtype)
            logger.info("dtype: %s", self.dtype_choice.describe())
            self.model = build_model(model_config, checkpoint.weights, self.dtype_choice, config.device,
                                     min(config.max_model_len or model_len, model_len))
            kv_bytes_per_block = self.model.kv_bytes_per_block(block_size)
        else:  # no model: the stand-in's runner (tokenloop.sim) produces the steps' logits and their time
            if config.speculative is not None:
                raise ConfigError("the simulator does not model speculative decoding: leave speculative unset")
            tokenizer, self.dtype_choice, self.model = None, None, None
            self.vocab_size = stand_in.vocab_size
            self.eos_token_ids = frozenset(() if stand_in.eos_token_id is None else (stand_in.eos_token_id,))
            model_len = stand_in.max_model_len
            kv_bytes_per_block = stand_in.kv_bytes_per_block(block_size)
        # Config and tokenizer only: the weights live in the model now, and the checkpoint's ggml blocks are
        # views of the mapped GGUF file, whose pages (the whole file, ~94 MiB) stayed resident while held.
        self.checkpoint = None if checkpoint is None else dataclasses.replace(checkpoint, weights={})
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        num_blocks = config.cache.num_blocks or max(
            1, config.cache.kv_cache_memory_bytes // kv_bytes_per_block)
        if num_blocks * block_size < self.max_model_len:
            # A request may grow to max_model_len; a pool smaller than that could never hold it alone.
            logger.info("max_model_len %d exceeds the KV cache (%d tokens); lowering it to fit",
                        self.max_model_len, num_blocks * block_size)
            self.max_model_len = num_blocks * block_size
        self.kv_events = KVEventLog() if config.cache.enable_kv_events else None
        self.kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching,
                                       events=self.kv_events)
        proposer = NgramProposer(config.speculative) if config.speculative is not None else None
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len, clock, proposer=proposer)
        self.runner = (ModelRunner(self.model, num_blocks, block_size) if stand_in is None
                       else stand_in.make_runner(num_blocks, block_size))
        self.sampler = Sampler(self.vocab_size, seed=config.seed)
        self.structured = StructuredOutputs(tokenizer, self.vocab_size)  # type: ignore[arg-type]
        if tokenizer is not None:
            # llguidance reads the vocabulary holding the GIL (7-12 s for Gemma 3's 262k tokens on a loaded
            # 2-core machine): here, before the heartbeat is watched, not on the first structured request.
            _ = self.structured.compiler
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self._prompt_logprobs_sent: dict[str, int] = {}  # prompt positions already reported, per request
        self.handoffs = HandoffStage(config.model, self.scheduler, self.kv_cache, self.runner, self.sampler,
                                     self.structured, self.vocab_size, self.eos_token_ids,
                                     config.scheduler.max_num_seqs, clock)
        self.num_steps = 0
        # Fault injection (tests, the soak): every step with work first sleeps this long, as a slower model
        # would; a test holds a request in flight with it instead of betting on the machine's speed.
        self.injected_step_delay_s = 0.0
        # Liveness: the core's loop ticks it per turn and the model per layer; a heartbeat reports it.
        self.progress = Progress()
        if self.model is not None:
            self.model.progress = self.progress

    # ---- requests in -----------------------------------------------------------------------------

    def validate(self, request: CoreRequest) -> None:
        """Raise InvalidRequestError for what this core can never run (ids outside the vocabulary...)."""
        vocab = self.vocab_size
        ids = request.prompt_token_ids
        if not ids:
            raise InvalidRequestError("the prompt is empty: at least one token is needed", param="prompt")
        # All plain ints in range, checked in C (a prompt is hundreds of ids); else the loop names the bad one.
        plain = set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab
        for token in () if plain else ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                raise InvalidRequestError(f"prompt token {token!r} is not a token id in [0, {vocab})",
                                          param="prompt")
        if request.params.n != 1:
            raise InvalidRequestError("the engine core takes one sample per request (n=1)", param="n")
        self.sampler.validate(request.params)

    def add_requests(self, requests: Sequence[CoreRequest]) -> None:
        """Queue requests, all or none; raises InvalidRequestError / CapacityError and queues nothing."""
        for request in requests:
            if request.request_id in self._requests:
                raise InvalidRequestError(f"request id {request.request_id!r} is already in use",
                                          param="request_id")
            self.validate(request)
        grammars = [self.structured.compile(r.params.structured_outputs) for r in requests]
        added: list[Request] = []
        try:
            for spec, grammar in zip(requests, grammars):
                request = Request(spec.request_id, spec.prompt_token_ids, spec.params, spec.arrival_ns,
                                  prompt=spec.prompt, priority=spec.priority, user=spec.user,
                                  cache_salt=spec.cache_salt, eos_token_ids=self.eos_token_ids)
                request.structured = grammar.new_matcher() if grammar is not None else None
                if request.structured is not None and spec.structured_replay:
                    self.structured.replay(request, spec.structured_replay)
                self.scheduler.add_request(request)
                added.append(request)
        except Exception:
            for request in added:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
            self.scheduler.take_releases()  # never admitted, as far as anyone outside knows
            raise
        for request in added:
            self._requests[request.request_id] = request
        if self.observers:
            now = self.clock()
            for request in added:
                self.observers.arrival(ArrivalRecord(
                    request.request_id, request.prompt, request.prompt_token_ids,
                    request.sampling_params.max_tokens, request.times.arrival, now, self.scheduler.num_waiting))

    def finish_requests(self, request_ids: Sequence[str], finish_reason: str = "abort",
                        stop_reason: int | str | None = None) -> list[CoreOutput]:
        """End requests now (cancelled, or stopped by the front end's stop string): their block
        references are released and no step produces anything more for them. Unknown ids are skipped."""
        status = _FINISH_STATUS[finish_reason]
        finals = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            request.stop_reason = stop_reason
            if request.status is RequestStatus.EXPORTING:
                self.handoffs.drop(request_id)  # a late ack or nack finds no lease
            self.scheduler.finish_request(request_id, status)
            finals.append(self._final_output(request, self._new_output(request, [])))
        releases = release_infos(self.scheduler.take_releases())
        if releases:
            self.observers.release(releases)
        return finals

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # ---- one step --------------------------------------------------------------------------------

    def step(self) -> CoreOutputs:
        """Go around the loop once; outputs of every request that got tokens or ended."""
        clock = self.clock
        start = clock()
        self.handoffs.expire()  # a lease nobody answered: the request runs here again
        schedule = self.scheduler.schedule()  # the KV stage inside: prefix hits, allocation, preemption
        self.runner.apply_block_diffs(schedule)
        schedule_end = clock()
        pending: dict[str, CoreOutput] = {}  # this step's output of each request so far
        failures: list[Failure] = []
        result: RunnerOutput | None = None
        if not schedule.is_empty:
            self.num_steps += 1
            if self.injected_step_delay_s > 0:
                time.sleep(self.injected_step_delay_s)
            schedule, result, failures = execute_isolated(self.runner, schedule)
        execute_end = clock()
        sampled: list[Sampled] = []
        speculating = result is not None and schedule.num_draft_tokens > 0
        if result is not None:
            self.scheduler.update_from_output(schedule)
            sampling = [schedule.scheduled[i].request for i in result.sample_indices]
            if speculating:  # a drafted row's logits rows: after its real token, then after each draft
                sampling = [schedule.scheduled[i].request for i in result.sample_indices
                            for _ in range(1 + len(schedule.scheduled[i].draft_token_ids))]
            if result.token_ids is not None:  # dictated by the runner (the simulator's): nothing to sample
                sampled = list(zip(sampling, result.token_ids, itertools.repeat(None)))
            else:
                assert result.logits is not None
                sampled, failed_sampling = sample_isolated(self.sampler, result.logits, sampling,
                                                           self.vocab_size)
                failures += failed_sampling
            self._record_prompt_logprobs(result, pending)
        sample_end = clock()
        num_accepted = 0
        if speculating:
            assert result is not None
            sampled, num_accepted = self._verify([schedule.scheduled[i] for i in result.sample_indices], sampled,
                                                 failures, sample_end, pending)
        else:
            for request, token, logprobs in sampled:
                try:
                    status = self._append(request, token, logprobs, sample_end, pending)
                    if status is not None:
                        self._finish(request, status, sample_end)
                except Exception as exc:  # noqa: BLE001 - one request's failure must not take the others down
                    _log_update_failure(request, exc)
                    failures.append((request, "updating", exc))
        for request, stage, cause in failures:
            self._fail_request(request, stage, cause)
        for request in [*schedule.failed, *(f[0] for f in failures)]:  # they end now, alone
            self._touch(pending, request)
        ended = self.scheduler.take_releases()
        for request, _, _, _ in ended:  # every request this step ended was released: its output says how
            output = pending.get(request.request_id)
            if output is not None:
                self._final_output(request, output)
        releases = release_infos(ended)
        outputs = list(pending.values())
        end = clock()
        record = None
        if self.observers and (not schedule.is_empty or schedule.preempted or releases):
            record = step_record(self.num_steps, (start, schedule_end, execute_end, sample_end, end), schedule,
                                 result, sampled, releases, gauges(self.scheduler, self.kv_cache), num_accepted)
            self.observers.step(record)
        kv_events = self.kv_events.flush(end) if self.kv_events is not None else None
        return CoreOutputs(outputs, sample_end, len(schedule.scheduled), record, kv_events=kv_events)

    # ---- handoff (tokenloop.core.handoff): a request moves to another engine under a lease -----------

    def export_request(self, request_id: str, skip_hashes: Sequence[int] = (),
                       lease_s: float = 30.0) -> KVSnapshot:
        """Pause the request (EXPORTING, blocks kept) and snapshot it with the blocks not in skip_hashes;
        InvalidRequestError for an unknown, finished or already exporting id."""
        return self.handoffs.export(self._unfinished(request_id), list(skip_hashes), lease_s,
                                    self._prompt_logprobs_sent.get(request_id, 0))

    def import_request(self, snapshot: KVSnapshot) -> ImportResult:
        """Take a request another engine exported, or refuse it with a reason (never raises for that)."""
        request_id = snapshot.request.request_id
        result, request = self.handoffs.import_(snapshot, request_id in self._requests)
        if request is not None:
            self._requests[request_id] = request
            if snapshot.request.num_prompt_logprobs_sent:
                self._prompt_logprobs_sent[request_id] = snapshot.request.num_prompt_logprobs_sent
        return result

    def complete_export(self, lease_id: str) -> bool:
        """The destination has it: release its references here (cached blocks stay reusable), report the
        release, and send no final output (the request lives on there). False for an unknown lease."""
        request = self.handoffs.complete(lease_id)
        if request is None:
            return False
        self._forget(request.request_id)
        releases = release_infos(self.scheduler.take_releases())
        if releases:
            self.observers.release(releases)
        return True

    def resume_export(self, lease_id: str) -> bool:
        """The destination refused it: it runs here again. False for an unknown (answered, expired) lease."""
        return self.handoffs.resume(lease_id)

    def precopy_blocks(self, request_id: str, skip_hashes: Sequence[int] = (),
                       max_blocks: int | None = None) -> list[KVBlockData]:
        """The request's computed full blocks not in skip_hashes (the first `max_blocks` of them), without
        pausing it (live migration copies in stages, so no one stage stalls this loop for long)."""
        return self.handoffs.precopy(self._unfinished(request_id), list(skip_hashes), max_blocks)

    def import_blocks(self, blocks: Sequence[KVBlockData]) -> int:
        """Store full blocks in the prefix cache, unreferenced and reusable; how many were new here."""
        return self.handoffs.store(list(blocks))

    def _unfinished(self, request_id: str) -> Request:
        request = self._requests.get(request_id)
        if request is None:
            raise InvalidRequestError(f"request {request_id!r} is not unfinished in this engine",
                                      param="request_id")
        return request

    # ---- KV events: a consumer that missed batches catches up or resyncs ---------------------------

    def kv_events_since(self, seq: int) -> list[KVEventBatch] | None:
        """Batches from `seq` on, or None when some fell out of the log (then resync from `kv_snapshot`)."""
        return self.kv_events.since(seq) if self.kv_events is not None else None

    def kv_snapshot(self) -> KVIndexSnapshot | None:
        """The whole prefix index as of the last batch (None with KV events off)."""
        return self.kv_events.snapshot(self.kv_cache.pool, self.clock()) if self.kv_events is not None else None

    # ---- update: append, stop checks -------------------------------------------------------------

    def _finish(self, request: Request, status: RequestStatus, now: int) -> None:
        """End a request its update stopped (the stamp of the step's tokens is its end)."""
        request.times.finished = now
        self.scheduler.finish_request(request.request_id, status)

    def _verify(self, items: list[ScheduledRequest], sampled: list[Sampled], failures: list[Failure], now: int,
                pending: dict[str, CoreOutput]) -> tuple[list[Sampled], int]:
        """A speculative step's update: per sampling row, the model's tokens after its real token and each
        draft; keep the drafts it agrees with plus its next token, appending them one by one with the stop
        checks, so a request stops exactly where plain decoding would. Returns the appended tokens and how
        many drafts were accepted."""
        rows: dict[str, list[tuple[int, TokenLogprobs | None]]] = {}
        for request, token, logprobs in sampled:
            rows.setdefault(request.request_id, []).append((token, logprobs))
        failed = {request.request_id for request, _, _ in failures}
        appended: list[Sampled] = []
        total_accepted = 0
        for item in items:
            request = item.request
            targets = rows.get(request.request_id)
            if targets is None or request.request_id in failed:
                continue
            accepted = accept_greedy(item.draft_token_ids, [token for token, _ in targets])
            total_accepted += accepted
            try:
                status, num_appended = None, 0
                for token, logprobs in targets[:accepted + 1]:
                    status = self._append(request, token, logprobs, now, pending)
                    appended.append((request, token, logprobs))
                    num_appended += 1
                    if status is not None:
                        break
                if item.draft_token_ids:  # every appended token but the last was an input with its K/V computed
                    self.scheduler.accept_drafts(item, num_appended - 1)
                if status is not None:
                    self._finish(request, status, now)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not take the others down
                _log_update_failure(request, exc)
                failures.append((request, "updating", exc))
        return appended, total_accepted

    def _append(self, request: Request, token: int, logprobs: TokenLogprobs | None, now: int,
                pending: dict[str, CoreOutput]) -> RequestStatus | None:
        """Append one token, stamp it, and run the core's stop checks in vLLM's order; the status it ends the
        request with, if any."""
        params = request.sampling_params
        request.append_output_token(token)
        request.times.record_token(now)
        output = pending.get(request.request_id)
        if output is None:
            output = pending[request.request_id] = self._new_output(request, [token])
        else:
            output.new_token_ids.append(token)
        if params.logprobs is not None and logprobs is not None:
            if output.new_logprobs is None:
                output.new_logprobs = []
            output.new_logprobs.append(logprobs)
        if request.structured is not None:  # (a call per token saved for the unconstrained rest)
            self.structured.accept(request, token)  # raises if the grammar refuses it: fails this request only
        num_output_tokens = len(request.output_token_ids)
        can_stop = num_output_tokens >= params.min_tokens
        status: RequestStatus | None = None
        if can_stop and not params.ignore_eos and token in request.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif request.structured is not None and request.structured.is_terminated:  # the grammar is complete
            status = RequestStatus.FINISHED_STOPPED
        elif can_stop and token in (params.stop_token_ids or ()):
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif num_output_tokens >= (params.max_tokens or self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        elif len(request.all_token_ids) >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        return status

    def _touch(self, pending: dict[str, CoreOutput], request: Request) -> CoreOutput:
        output = pending.get(request.request_id)
        if output is None:
            output = pending[request.request_id] = self._new_output(request, [])
        return output

    @staticmethod
    def _new_output(request: Request, token_ids: list[int]) -> CoreOutput:
        # With the request's counters now: the update stage never changes them (scheduling does). Positional
        # (no logprobs, no finish yet, then the counters): keywords cost twice the call here, once a row a step.
        return CoreOutput(request.request_id, token_ids, None, None, None, None, None,
                          request.times.first_scheduled, request.num_cached_tokens, request.num_preemptions)

    def _final_output(self, request: Request, output: CoreOutput) -> CoreOutput:
        """Fill in how `request` ended; forget it."""
        output.finish_reason = request.finish_reason
        output.stop_reason = request.stop_reason
        output.error, output.error_param = request.error, request.error_param
        self._forget(request.request_id)
        return output

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._prompt_logprobs_sent.pop(request_id, None)

    def _record_prompt_logprobs(self, result: RunnerOutput, pending: dict[str, CoreOutput]) -> None:
        for piece in result.prompt_logits:
            request = self._requests.get(piece.request_id)
            if request is None:
                continue
            sent = self._prompt_logprobs_sent.get(piece.request_id, 0)
            if piece.first_target != sent + 1:
                continue  # recomputed after a preemption: already reported
            targets = torch.tensor(request.prompt_token_ids[piece.first_target:piece.first_target
                                                            + piece.logits.shape[0]])
            values = self.sampler.prompt_logprobs(piece.logits, targets,
                                                  request.sampling_params.prompt_logprobs or 0)
            output = self._touch(pending, request)
            if output.new_prompt_logprobs is None:
                output.new_prompt_logprobs = []
            output.new_prompt_logprobs.extend(values)
            self._prompt_logprobs_sent[piece.request_id] = sent + len(values)

    def _fail_request(self, request: Request, stage: str, cause: BaseException) -> None:
        if isinstance(cause, InvalidRequestError):  # the request's own content: the client is told why
            request.error, request.error_param = str(cause), cause.param
        else:  # the exception is this request's own (isolated): its text may help an offline caller
            detail = f" ({type(cause).__name__}: {str(cause)[:200]})" if cause is not None else ""
            request.error = f"the server failed while {stage} this request{detail}"
        if request.times.finished is None:
            request.times.finished = self.clock()
        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)


def _log_update_failure(request: Request, exc: Exception) -> None:
    if isinstance(exc, InvalidRequestError):  # the request's own fault (its grammar's limits): no traceback
        logger.info("request %s failed: %s", request.request_id, exc)
    else:
        logger.exception("update of %s failed", request.request_id)
