"""EngineCore: the serving loop over one model, token ids in and token ids out.

One `step()` goes once around the loop:

    schedule -> execute -> sample -> update -> release -> record

Scheduling includes the KV stage (prefix hits, allocation, preemption); the update appends each sampled
token and stops a request by EOS, stop token ids, its grammar or its length (stop strings are text: the
front end finds them and finishes the request here). Each step ends with one `StepRecord` handed to the
observers; nothing they do reaches back into the loop. The same class runs in-process (the offline `LLM`)
and inside the server's engine process.

Long module: the core's one face: the loop, and the thin calls the core loop dispatches by name (requests,
handoff, LoRA adapters, KV events), each a few lines forwarding to the room that owns its state.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from tokenloop.config import EngineConfig, KVGroup
from tokenloop.core.adapters import AdapterStage, adapter_dtype
from tokenloop.core.handoff import HandoffStage, ImportResult, KVBlockData, KVSnapshot
from tokenloop.core.heartbeat import Progress
from tokenloop.core.isolation import Failure, Sampled, execute_isolated, sample_isolated
from tokenloop.core.kv_cache import KVCacheManager
from tokenloop.core.kv_events import KVEventBatch, KVEventLog, KVIndexSnapshot
from tokenloop.core.messages import CoreOutput, CoreOutputs, CoreRequest
from tokenloop.core.recording import gauges, release_infos, step_record
from tokenloop.core.scheduler import Scheduler, SchedulerStats
from tokenloop.core.scheduler_output import SchedulerOutput
from tokenloop.core.speculative import NgramProposer
from tokenloop.core.update import StepUpdate, Updater, new_output, touch
from tokenloop.errors import AdapterNotFoundError, ConfigError, InvalidRequestError
from tokenloop.model.dtypes import CpuFeatures, DtypeChoice, build_model, require_device, resolve_dtype
from tokenloop.model.loader import Checkpoint, load_checkpoint
from tokenloop.observe.records import ArrivalRecord, ObserverSet, Observes, ReleaseInfo
from tokenloop.request import Clock, FinishReason, Request, RequestStatus, default_clock
from tokenloop.runner import ModelRunner, RunnerOutput
from tokenloop.sampler import Sampler
from tokenloop.structured.engine_hooks import StructuredOutputs

if TYPE_CHECKING:
    from tokenloop.model.models.llama import LlamaModel
    from tokenloop.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

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
        self.dtype_choice: DtypeChoice | None = None
        self.model: LlamaModel | None = None
        if stand_in is None:
            require_device(config.device)  # before reading a checkpoint: a wrong device fails fast
            checkpoint = checkpoint or load_checkpoint(config.model, keep_quantized=True)
            tokenizer: Tokenizer | None = checkpoint.tokenizer
            model_len, kv_bytes_per_block = self._build_model(config, checkpoint)
        else:  # no model: the stand-in's runner (tokenloop.sim) produces the steps' logits and their time
            if config.speculative is not None:
                raise ConfigError("the simulator does not model speculative decoding: leave speculative unset")
            tokenizer = None
            self.vocab_size = stand_in.vocab_size
            self.eos_token_ids = frozenset(() if stand_in.eos_token_id is None else (stand_in.eos_token_id,))
            model_len = stand_in.max_model_len
            kv_bytes_per_block = stand_in.kv_bytes_per_block(block_size)
        # Config and tokenizer only: the weights live in the model now, and the checkpoint's ggml blocks are
        # views of the mapped GGUF file, whose pages (the whole file, ~94 MiB) stayed resident while held.
        self.checkpoint = None if checkpoint is None else dataclasses.replace(checkpoint, weights={})
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        num_blocks = self._make_kv_cache(config, kv_bytes_per_block)
        proposer = NgramProposer(config.speculative) if config.speculative is not None else None
        self.adapters = None if config.lora is None or self.model is None else AdapterStage(
            config.lora, self.model, adapter_dtype(self.dtype_choice, config.lora.lora_dtype))
        max_loras = config.lora.max_loras if config.lora is not None and self.adapters is not None else 0
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len, clock,
                                   proposer=proposer, max_loras=max_loras)
        if stand_in is not None:
            self.runner = stand_in.make_runner(num_blocks, block_size)
        else:
            assert self.model is not None  # built above when nothing stands in for it
            self.runner = ModelRunner(self.model, num_blocks, block_size,
                                      self.adapters.slots if self.adapters is not None else None)
        self.sampler = Sampler(self.vocab_size, seed=config.seed)
        self.structured = StructuredOutputs(tokenizer, self.vocab_size)  # type: ignore[arg-type]
        if tokenizer is not None:
            # llguidance reads the vocabulary holding the GIL (7-12 s for Gemma 3's 262k tokens on a loaded
            # 2-core machine): here, before the heartbeat is watched, not on the first structured request.
            _ = self.structured.compiler
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self._prompt_logprobs_sent: dict[str, int] = {}  # prompt positions already reported, per request
        self.updater = Updater(self.scheduler, self.structured, self.max_model_len, clock)
        self.handoffs = HandoffStage(config.model, self.scheduler, self.kv_cache, self.runner, self.sampler,
                                     self.structured, self.vocab_size, self.eos_token_ids,
                                     config.scheduler.max_num_seqs, clock)
        self.num_steps = 0
        # Fault injection (tests, the soak): every step with work first sleeps this long, as a slower model
        # would; a test holds a request in flight with it instead of betting on the machine's speed.
        self.injected_step_delay_s = 0.0
        # Liveness: the core's loop ticks it per turn and the model per layer; a heartbeat reports it.
        self.progress = Progress(layer_ticks=torch.zeros(1, dtype=torch.int64))
        if self.model is not None:
            self.model.progress = self.progress

    def _build_model(self, config: EngineConfig, checkpoint: Checkpoint) -> tuple[int, int]:
        """Pick the dtypes and build the model from the checkpoint's weights; returns (the model's context
        length, KV bytes per block)."""
        model_config = checkpoint.config
        # Every end-of-generation id stops a request: eos, and eot / generation_config's others (Gemma's
        # <end_of_turn>, Llama 3's <|eot_id|>).
        # (A checkpoint of random weights may come without a tokenizer: token ids in, token ids out.)
        tokenizer = checkpoint.tokenizer
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
        model_len = model_config.max_position_embeddings
        self.dtype_choice = resolve_dtype(config.dtype, config.weight_dtype, config.device,
                                          checkpoint.is_quantized, CpuFeatures.detect(), config.kv_cache_dtype)
        logger.info("dtype: %s", self.dtype_choice.describe())
        self.model = build_model(model_config, checkpoint.weights, self.dtype_choice, config.device,
                                 min(config.max_model_len or model_len, model_len))
        return model_len, self.model.kv_bytes_per_block(config.cache.block_size)

    def _make_kv_cache(self, config: EngineConfig, kv_bytes_per_block: int) -> int:
        """The KV pool (its events log if asked for) in the memory the config gives it, and max_model_len
        lowered to what one request can hold in it; returns the pool's number of blocks."""
        num_blocks = config.cache.num_blocks or max(
            1, config.cache.kv_cache_memory_bytes // kv_bytes_per_block)
        self.kv_events = KVEventLog() if config.cache.enable_kv_events else None
        self.kv_cache = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                       events=self.kv_events,
                                       groups=self.model.kv_groups() if self.model is not None else (KVGroup(),))
        pool_tokens = self.kv_cache.max_tokens_alone(config.scheduler.max_num_batched_tokens)
        if pool_tokens < self.max_model_len:
            # A request may grow to max_model_len; a pool smaller than that could never hold it alone.
            logger.info("max_model_len %d exceeds the KV cache (%d tokens); lowering it to fit",
                        self.max_model_len, pool_tokens)
            self.max_model_len = pool_tokens
        return num_blocks

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
        if request.lora_name is not None:
            if self.adapters is None:
                raise AdapterNotFoundError(f"The model {request.lora_name!r} does not exist: this engine "
                                           "serves no LoRA adapters", param="model")
            self.adapters.require(request.lora_name)
        self.sampler.validate(request.params)

    def add_requests(self, requests: Sequence[CoreRequest]) -> None:
        """Queue requests, all or none; raises InvalidRequestError / CapacityError and queues nothing."""
        for core_request in requests:
            if core_request.request_id in self._requests:
                raise InvalidRequestError(f"request id {core_request.request_id!r} is already in use",
                                          param="request_id")
            self.validate(core_request)
        grammars = [self.structured.compile(r.params.structured_outputs) for r in requests]
        added: list[Request] = []
        try:
            for spec, grammar in zip(requests, grammars):
                request = Request(spec.request_id, spec.prompt_token_ids, spec.params, spec.arrival_ns,
                                  prompt=spec.prompt, priority=spec.priority, user=spec.user,
                                  cache_salt=spec.cache_salt, eos_token_ids=self.eos_token_ids,
                                  lora_name=spec.lora_name)
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
                    request.sampling_params.max_tokens, request.times.arrival, now, self.scheduler.num_waiting,
                    lora_name=request.lora_name))

    def finish_requests(self, request_ids: Sequence[str], finish_reason: FinishReason = FinishReason.ABORT,
                        stop_reason: int | str | None = None) -> list[CoreOutput]:
        """End requests now (cancelled, or stopped by the front end's stop string): their block
        references are released and no step produces anything more for them. Unknown ids are skipped."""
        status = FinishReason(finish_reason).status
        finals = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            request.stop_reason = stop_reason
            if request.status is RequestStatus.EXPORTING:
                self.handoffs.drop(request_id)  # a late ack or nack finds no lease
            self.scheduler.finish_request(request_id, status)
            finals.append(self._final_output(request, new_output(request, [])))
        releases = release_infos(self.scheduler.take_releases())
        if releases:
            self.observers.release(releases)
        return finals

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- LoRA adapters (tokenloop.core.adapters) ---------------------------------------------------

    def list_loras(self) -> list[dict[str, object]]:
        """The LoRA adapters this engine serves (name, path, rank, ...); empty without LoRA."""
        return [] if self.adapters is None else self.adapters.describe()

    def load_lora(self, name: str, path: str) -> dict[str, object]:
        """Serve one more adapter, read from under the configured `lora_dir`; raises AdapterLoadError."""
        if self.adapters is None:
            raise ConfigError("this engine was started without LoRA: start it with --enable-lora or --lora")
        adapter = self.adapters.load(name, path)
        return {"name": adapter.name, "rank": adapter.rank, "load_ms": round(adapter.load_s * 1e3, 2)}

    def lora_in_flight(self, name: str) -> list[str]:
        """The unfinished requests running with adapter `name`."""
        return [rid for rid, request in self._requests.items() if request.lora_name == name]

    def unload_lora(self, name: str) -> list[CoreOutput]:
        """Stop serving `name`: its unfinished requests end now with an error saying so (their finals are
        returned); later requests naming it get 404."""
        if self.adapters is None:
            raise AdapterNotFoundError(f"The model {name!r} does not exist: this engine serves no LoRA "
                                       "adapters", param="model")
        self.adapters.require(name)
        ending = self.lora_in_flight(name)
        for request_id in ending:  # blamed on `model`: the client is told why (a 4xx naming it), not a 500
            request = self._requests[request_id]
            request.error = f"the LoRA adapter {name!r} was unloaded while this request ran"
            request.error_param = "model"
        finals = self.finish_requests(ending, FinishReason.ERROR)
        self.adapters.unload(name)
        return finals

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # ---- one step --------------------------------------------------------------------------------

    def step(self) -> CoreOutputs:
        """Go around the loop once; outputs of every request that got tokens or ended."""
        stamps = [self.clock()]  # start, then the end of schedule, execute, sample, and the step
        self.handoffs.expire()  # a lease nobody answered: the request runs here again
        schedule = self.scheduler.schedule()  # the KV stage inside: prefix hits, allocation, preemption
        self.runner.apply_block_diffs(schedule)
        stamps.append(self.clock())
        schedule, result, failures = self._execute(schedule)
        stamps.append(self.clock())
        pending: dict[str, CoreOutput] = {}  # this step's output of each request so far
        sampled = self._sample(schedule, result, failures, pending)
        stamps.append(self.clock())
        update = self.updater.update(schedule, result, sampled, failures, pending, now=stamps[-1])
        releases = self._release(pending)
        stamps.append(self.clock())
        return self._report(schedule, result, update, releases, pending, stamps)

    def _execute(self, schedule: SchedulerOutput) -> tuple[SchedulerOutput, RunnerOutput | None, list[Failure]]:
        """One batched forward over the scheduled rows; rows whose execution failed leave the schedule."""
        if schedule.is_empty:
            return schedule, None, []
        self.num_steps += 1
        if self.injected_step_delay_s > 0:
            time.sleep(self.injected_step_delay_s)
        return execute_isolated(self.runner, schedule)

    def _sample(self, schedule: SchedulerOutput, result: RunnerOutput | None, failures: list[Failure],
                pending: dict[str, CoreOutput]) -> list[Sampled]:
        """The scheduled requests move on past the computed tokens; each sampling row gets its token (a
        drafted row one after its real token and one after each draft); prompt logprobs go to `pending`."""
        if result is None:
            return []
        self.scheduler.update_from_output(schedule)
        scheduled = schedule.scheduled
        sampling = ([scheduled[i].request for i in result.sample_indices
                     for _ in range(1 + len(scheduled[i].draft_token_ids))]
                    if schedule.num_draft_tokens else [scheduled[i].request for i in result.sample_indices])
        if result.token_ids is not None:  # dictated by the runner (the simulator's): nothing to sample
            sampled: list[Sampled] = list(zip(sampling, result.token_ids, itertools.repeat(None)))
        else:
            assert result.logits is not None
            sampled, failed_sampling = sample_isolated(self.sampler, result.logits, sampling, self.vocab_size)
            failures += failed_sampling
        self._record_prompt_logprobs(result, pending)
        return sampled

    def _release(self, pending: dict[str, CoreOutput]) -> list[ReleaseInfo]:
        """Every request this step ended drops its block references; its output says how it ended."""
        ended = self.scheduler.take_releases()
        for request, _, _, _ in ended:
            output = pending.get(request.request_id)
            if output is not None:
                self._final_output(request, output)
        return release_infos(ended)

    def _report(self, schedule: SchedulerOutput, result: RunnerOutput | None, update: StepUpdate,
                releases: list[ReleaseInfo], pending: dict[str, CoreOutput], stamps: list[int]) -> CoreOutputs:
        """The step's outputs, its record (to the observers) and its KV events."""
        record = None
        if self.observers and (not schedule.is_empty or schedule.preempted or releases):
            record = step_record(self.num_steps, tuple(stamps), schedule, result, update.appended, releases,
                                 gauges(self.scheduler, self.kv_cache), update.num_accepted)
            self.observers.step(record)
        kv_events = self.kv_events.flush(stamps[-1]) if self.kv_events is not None else None
        return CoreOutputs(list(pending.values()), stamps[3], len(schedule.scheduled), record,
                           kv_events=kv_events)

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
        return self.kv_cache.pool.index_snapshot(self.clock()) if self.kv_events is not None else None

    # ---- release: how a request ended, and forgetting it ----------------------------------------------

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
            output = touch(pending, request)
            if output.new_prompt_logprobs is None:
                output.new_prompt_logprobs = []
            output.new_prompt_logprobs.extend(values)
            self._prompt_logprobs_sent[piece.request_id] = sent + len(values)
