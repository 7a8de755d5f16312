"""Simulated replicas: N simulated engine cores on one virtual timeline, a router choosing per request.

Each replica is a `SimulatedEngine` (the real scheduler and KV cache, KV events on) with its own clock;
one event loop keeps them on a single timeline. The next event is always the earliest: a replica's step
ending (its outputs are delivered to the router's load tracker at that instant, then it starts its next
step if it has work) or a request arriving (routed by what the tracker knows at that instant, then added
to the chosen replica; an idle replica starts a step at once). Frames ending at the same instant as an
arrival are delivered first, so the router sees the stats of that instant.

The router itself lives in `tokenloop.cluster` (which may import the simulator, not the other way round):
it is passed in as two callables, `route` and `on_frame`.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenloop.config import EngineConfig
from tokenloop.core.messages import CoreOutputs
from tokenloop.errors import TokenloopError
from tokenloop.observe.records import EngineObserver
from tokenloop.request import SamplingParams
from tokenloop.sim.cost import StepCostModel
from tokenloop.sim.engine import SimulatedEngine, SimulatedOutput, cyclic_gc_paused

# route(request, now_ns) -> replica index; on_frame(replica, outputs) as each step's outputs arrive.
Route = Callable[["SimRequest", int], int]
OnFrame = Callable[[int, CoreOutputs], None]


class ReplicaClock:
    """One replica's virtual clock: moved by its steps (the runner) and forward to arrivals."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now

    def advance_by(self, ns: int) -> None:
        self.now += ns

    def advance_to(self, t_ns: int) -> None:
        self.now = max(self.now, t_ns)


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a cluster replay, token ids only; `session` is its affinity key (the trace's user)."""

    request_id: str
    arrival_ns: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    session: str | None = None
    cache_salt: str | None = None


@dataclass(slots=True)
class ReplicaResult:
    """One replica's counters after a run."""

    index: int
    num_requests: int
    num_steps: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    modelled_busy_s: float

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None


@dataclass(slots=True)
class ClusterRun:
    """What a cluster replay produced: each finished request with its replica, refusals, per replica."""

    outputs: dict[str, tuple[int, SimulatedOutput]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    replicas: list[ReplicaResult] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def num_steps(self) -> int:
        return sum(r.num_steps for r in self.replicas)


class SimulatedCluster:
    """N simulated replicas of one engine config and cost model; `run` replays requests through a router."""

    def __init__(self, num_replicas: int, config: EngineConfig, cost_model: StepCostModel, *, vocab_size: int,
                 max_model_len: int, kv_bytes_per_token: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not config.cache.enable_kv_events:
            raise ValueError("simulated replicas need KV events on (the router mirrors their prefix caches)")
        self.now = 0  # the timeline: the instant of the event being processed
        self.clocks = [ReplicaClock() for _ in range(num_replicas)]
        # A no-op observer makes each core build its step records: the tracker reads their gauges.
        self.engines = [SimulatedEngine(config, cost_model, clock, vocab_size=vocab_size,
                                        max_model_len=max_model_len, kv_bytes_per_token=kv_bytes_per_token,
                                        observers=[EngineObserver()])
                        for clock in self.clocks]

    def now_ns(self) -> int:
        """The timeline's current instant (a load tracker's clock)."""
        return self.now

    def run(self, requests: Sequence[SimRequest], route: Route, on_frame: OnFrame) -> ClusterRun:
        """Replay `requests` by their arrival times; every request runs to its `max_tokens` (greedy)."""
        with cyclic_gc_paused():
            return self._run(requests, route, on_frame)

    def _run(self, requests: Sequence[SimRequest], route: Route, on_frame: OnFrame) -> ClusterRun:
        began = time.perf_counter()
        result = ClusterRun()
        pending = sorted(requests, key=lambda r: r.arrival_ns)  # stable: input order among equal arrivals
        next_arrival = 0
        frames: list[tuple[int, int]] = []  # (step end, replica) of the steps in progress
        in_flight: list[CoreOutputs | None] = [None] * len(self.engines)
        counts = [0] * len(self.engines)
        steps = [0] * len(self.engines)

        def start_step(index: int) -> None:
            engine = self.engines[index]
            if not engine.has_unfinished_requests():
                return
            outputs, finished = engine.step_outputs()
            for output in finished:
                result.outputs[output.request_id] = (index, output)
            if outputs.num_scheduled == 0:
                return  # nothing could run (it waits for the next arrival); no frame to deliver
            steps[index] += 1
            in_flight[index] = outputs
            heapq.heappush(frames, (self.clocks[index].now, index))

        while next_arrival < len(pending) or frames:
            t_arrival = pending[next_arrival].arrival_ns if next_arrival < len(pending) else None
            if frames and (t_arrival is None or frames[0][0] <= t_arrival):
                self.now, index = heapq.heappop(frames)
                outputs, in_flight[index] = in_flight[index], None
                assert outputs is not None
                on_frame(index, outputs)
                start_step(index)
                continue
            assert t_arrival is not None
            self.now = t_arrival
            kicked: list[int] = []
            while next_arrival < len(pending) and pending[next_arrival].arrival_ns == t_arrival:
                request = pending[next_arrival]
                next_arrival += 1
                index = route(request, t_arrival)
                if not self._add(index, request, t_arrival, result):
                    continue
                counts[index] += 1
                if in_flight[index] is None and index not in kicked:
                    kicked.append(index)
            for index in kicked:  # idle until now: they start a step at this instant
                self.clocks[index].advance_to(t_arrival)
                start_step(index)
        result.replicas = self._replica_results(counts, steps)
        result.wall_s = time.perf_counter() - began
        return result


    def _add(self, index: int, request: SimRequest, t_arrival: int, result: ClusterRun) -> bool:
        """Add `request` to replica `index`; one it refuses (longer than the cache holds...) is a failed
        request."""
        try:
            self.engines[index].add_request(
                request.request_id, None, _params(request.max_tokens),
                prompt_token_ids=request.prompt_token_ids, priority=request.priority,
                user=request.session, cache_salt=request.cache_salt, arrival_ns=t_arrival)
        except TokenloopError as exc:
            result.errors[request.request_id] = str(exc)
            return False
        return True

    def _replica_results(self, counts: list[int], steps: list[int]) -> list[ReplicaResult]:
        """Each replica's counts once the run is over (each must have finished every request)."""
        replicas = []
        for index, engine in enumerate(self.engines):
            if engine.has_unfinished_requests():
                raise RuntimeError(f"replica {index} holds requests but schedules none")
            stats = engine.stats()
            replicas.append(ReplicaResult(index, counts[index], steps[index], stats.num_preemptions,
                                          stats.prefix_cache_queries, stats.prefix_cache_hits,
                                          engine.runner.modelled_ns / 1e9))
        return replicas

def _params(max_tokens: int) -> SamplingParams:
    """As every replay: greedy, exactly `max_tokens` tokens."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
