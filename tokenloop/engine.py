"""LLMEngine: the front end's update stage and an in-process engine core, behind vLLM's engine API.

    engine = LLMEngine(config)
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for output in engine.step():  # RequestOutput deltas; the last one has finished=True
            ...

`step()` runs one `EngineCore.step()` (schedule -> execute -> sample -> update -> release -> record) and
turns its token ids into text and outputs (`OutputProcessor`). A stop string found in the text finishes
its request in the core at once, before the next step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenloop.config import EngineConfig
from tokenloop.core.engine_core import EngineCore
from tokenloop.core.messages import CoreOutputs
from tokenloop.core.scheduler import SchedulerStats
from tokenloop.errors import InvalidRequestError
from tokenloop.model.loader import Checkpoint
from tokenloop.observe.records import Observes
from tokenloop.outputs import OutputProcessor, RequestOutput
from tokenloop.request import Clock, FinishReason, LoRARequest, SamplingParams, default_clock
from tokenloop.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenloop.core.kv_cache import KVCacheManager
    from tokenloop.core.scheduler import Scheduler
    from tokenloop.model.dtypes import DtypeChoice
    from tokenloop.model.models.llama import LlamaModel
    from tokenloop.runner import ModelRunner
    from tokenloop.sampler import Sampler
    from tokenloop.structured.engine_hooks import StructuredOutputs

__all__ = ["LLMEngine"]


class LLMEngine:
    """The serving loop over one model: `add_request`, `abort_request`, `step`.

    `observers` receive the core's records (`tokenloop.observe.records`); a `tracer` is one of them.
    """

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None,
                 clock: Clock = default_clock, tracer: Observes | None = None,
                 observers: Sequence[Observes] = ()) -> None:
        self.config = config
        self.clock = clock
        self.tracer = tracer
        everyone = [*observers, *([tracer] if tracer is not None else [])]
        self.core = EngineCore(config, checkpoint, clock, everyone)
        self.checkpoint = self.core.checkpoint
        self.tokenizer: Tokenizer = self.checkpoint.tokenizer
        self.outputs = OutputProcessor(self.tokenizer)
        self._request_counter = 0
        if tracer is not None and hasattr(tracer, "bind"):
            tracer.bind(self.tokenizer, self.core.kv_cache.block_size, clock)

    def add_observer(self, observer: Observes) -> None:
        """Receive the core's records from now on (`tokenloop.observe.records`)."""
        self.core.observers.add(observer)

    # The core's rooms, for tools and tests that look inside a step.
    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def kv_cache(self) -> KVCacheManager:
        return self.core.kv_cache

    @property
    def runner(self) -> ModelRunner:  # or the simulator's stand-in
        return self.core.runner

    @property
    def sampler(self) -> Sampler:
        return self.core.sampler

    @property
    def model(self) -> LlamaModel | None:
        return self.core.model

    @property
    def structured(self) -> StructuredOutputs:
        return self.core.structured

    @property
    def dtype_choice(self) -> DtypeChoice | None:
        return self.core.dtype_choice

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

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
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request (text or token ids), with the LoRA adapter `lora_request` names if given. Returns
        its id. Raises InvalidRequestError (AdapterNotFoundError for an adapter not served) /
        CapacityError."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = f"req-{self._request_counter}"
            self._request_counter += 1
        ids = self._prompt_ids(prompt, prompt_token_ids)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max(1, self.max_model_len - len(ids)))
        arrival = self.clock() if arrival_ns is None else arrival_ns
        text = prompt if isinstance(prompt, str) else None
        lora_name = None if lora_request is None else self._adapter(lora_request)
        core_requests = self.outputs.add(request_id, text, ids, params, arrival, priority=priority, user=user,
                                         cache_salt=cache_salt, lora_name=lora_name)
        try:
            self.core.add_requests(core_requests)
        except Exception:
            self.outputs.forget(request_id)
            raise
        return request_id

    def _adapter(self, lora_request: LoRARequest) -> str:
        """The adapter's name, loading it from its path first when the engine does not serve it yet."""
        served = self.core.adapters
        if served is not None and lora_request.lora_path is not None \
                and lora_request.lora_name not in served.names:
            # The caller's own path, as vLLM's LLM loads it: no allowed-directory check offline.
            served.load(lora_request.lora_name, lora_request.lora_path, at_start=True)
        return lora_request.lora_name

    def unload_lora(self, name: str) -> list[RequestOutput]:
        """Stop serving adapter `name`; its unfinished requests end with an error saying so (their finals)."""
        return self.outputs.process(CoreOutputs(self.core.unload_lora(name), self.clock(), 0)).outputs

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Cancel requests: their block references are released now and no step produces anything more
        for them. Returns each one's final output (finish_reason "abort", with its metrics)."""
        core_ids = [cid for rid in ([request_ids] if isinstance(request_ids, str) else request_ids)
                    for cid in self.outputs.core_ids(rid)]
        if not core_ids:
            return []
        finals = self.core.finish_requests(core_ids, FinishReason.ABORT)
        return self.outputs.process(CoreOutputs(finals, self.clock(), 0)).outputs

    def has_unfinished_requests(self) -> bool:
        return self.outputs.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return self.outputs.num_unfinished_requests

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    # ---- one step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Go around the loop once; return the outputs of every request that progressed or ended."""
        core_outputs = self.core.step()
        processed = self.outputs.process(core_outputs)
        for core_id, stop in processed.stopped:  # found in the text: the core stops computing it now
            self.core.finish_requests([core_id], FinishReason.STOP, stop)
        if processed.failed:
            self.core.finish_requests(processed.failed, FinishReason.ERROR)
        return processed.outputs
