"""SimulatedEngine: a simulated `EngineCore` behind the slice of `LLMEngine`'s API a trace replay uses.

There is no text and no detokenizer: token ids in, token ids out, and each finished request comes back
once with its lifecycle times (the `RequestMetrics` fields a replay reads). Only finished requests are
returned by `step()`, because per-token deltas are what a simulation at 10^5 requests cannot afford.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from tokenloop.config import EngineConfig
from tokenloop.core.messages import CoreOutputs, CoreRequest
from tokenloop.core.scheduler import SchedulerStats
from tokenloop.errors import InvalidRequestError
from tokenloop.observe.records import Observes
from tokenloop.request import NS_PER_S, Request, SamplingParams
from tokenloop.sim.cost import StepCostModel
from tokenloop.sim.runner import AdvancingClock, SimulatedRunner, sim_core


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for a simulated run, back as it was after.

    A run allocates millions of small objects (a step's rows, outputs and records) next to ~10^5-10^6
    long-lived ones (block pools, requests, finished records), and every full collection rescans the
    long-lived ones: a third of an 8-replica run's CPU time (8,000 requests: 19.8 vs 13.2 s). None of the
    garbage is cyclic (the same run's peak RSS was the same with and without the collector), so reference
    counting frees it at once either way.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(slots=True)
class SimulatedMetrics:
    """A finished request's lifecycle, seconds on the engine clock (RequestMetrics' names)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    itls_s: list[float]
    num_cached_tokens: int
    num_preemptions: int


@dataclass(slots=True)
class SimulatedCompletion:
    token_ids: list[int]
    finish_reason: str | None


@dataclass(slots=True)
class SimulatedOutput:
    """What a replay reads of a finished request's `RequestOutput`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[SimulatedCompletion]
    metrics: SimulatedMetrics
    finished: bool = True


class SimulatedEngine:
    """`add_request` / `step` / `has_unfinished_requests` over a simulated core on a virtual clock."""

    def __init__(self, config: EngineConfig, cost_model: StepCostModel, clock: AdvancingClock, *,
                 vocab_size: int, max_model_len: int, kv_bytes_per_token: int,
                 observers: Sequence[Observes] = (),
                 tokenize: Callable[[str], list[int]] | None = None) -> None:
        self.config = config
        self.clock = clock
        self.core = sim_core(config, cost_model, clock, vocab_size=vocab_size, max_model_len=max_model_len,
                             kv_bytes_per_token=kv_bytes_per_token, observers=observers)
        self._tokenize = tokenize
        # The core's own Request of each unfinished request: its output tokens and their time stamps are
        # read once, when it finishes, instead of being copied out of every step's outputs.
        self._tracked: dict[str, Request] = {}

    def add_observer(self, observer: Observes) -> None:
        self.core.observers.add(observer)

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv_cache(self):
        return self.core.kv_cache

    @property
    def runner(self) -> SimulatedRunner:
        return self.core.runner  # type: ignore[return-value]

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    def add_request(self, request_id: str, prompt: str | Sequence[int] | None,
                    params: SamplingParams | None = None, *, prompt_token_ids: Sequence[int] | None = None,
                    priority: int = 0, user: str | None = None, cache_salt: str | None = None,
                    arrival_ns: int | None = None) -> str:
        """Queue a request; raises InvalidRequestError / CapacityError as the real engine does."""
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
        elif isinstance(prompt, str):
            if self._tokenize is None:
                raise InvalidRequestError("the simulator takes token ids; this prompt is text and no "
                                          "tokenizer was given", param="prompt")
            ids = self._tokenize(prompt)
        elif prompt is not None:
            ids = list(prompt)
        else:
            raise InvalidRequestError("a prompt (token ids) is required", param="prompt")
        params = params or SamplingParams(max_tokens=16)
        arrival = self.clock() if arrival_ns is None else arrival_ns
        self.core.add_requests([CoreRequest(request_id, ids, params, arrival, priority=priority, user=user,
                                            cache_salt=cache_salt)])
        request = self.core.scheduler.get_request(request_id)
        assert request is not None, f"{request_id} was queued but the scheduler does not hold it"
        self._tracked[request_id] = request
        return request_id

    def step(self) -> list[SimulatedOutput]:
        """One core step; the outputs of the requests that finished in it."""
        return self.step_outputs()[1]

    def step_outputs(self) -> tuple[CoreOutputs, list[SimulatedOutput]]:
        """One core step: the core's own outputs (for a router's load tracker) and the finished requests."""
        outs = self.core.step()
        stamp = outs.timestamp_ns
        finished = []
        for out in outs.outputs:
            if out.finish_reason is None:
                continue
            request = self._tracked.pop(out.request_id, None)
            if request is not None:
                finished.append(self._output(request, out.finish_reason, out.first_scheduled_ns, stamp,
                                             out.num_cached_tokens, out.num_preemptions))
        return outs, finished

    @staticmethod
    def _output(request: Request, finish_reason: str, first_scheduled_ns: int | None, finished_ns: int,
                num_cached: int, num_preemptions: int) -> SimulatedOutput:
        # Every token the core appended was stamped with its step's timestamp_ns (the outputs' stamp).
        times = request.times.token_times

        def s(ns: int | None) -> float | None:
            return None if ns is None else ns / NS_PER_S

        itls = [(b - a) / NS_PER_S for a, b in itertools.pairwise(times)]
        metrics = SimulatedMetrics(request.times.arrival / NS_PER_S, s(first_scheduled_ns),
                                   s(times[0] if times else None), s(times[-1] if times else None),
                                   finished_ns / NS_PER_S, itls, num_cached, num_preemptions)
        return SimulatedOutput(request.request_id, request.prompt_token_ids,
                               [SimulatedCompletion(list(request.output_token_ids), finish_reason)], metrics)
