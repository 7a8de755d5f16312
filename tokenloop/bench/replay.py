"""Replaying a trace in-process: the engine under a policy, or HF transformers static batching.

The replay loop adds each request when its arrival time has passed and otherwise steps the engine. Time
comes from one of three clocks:

- `virtual` (default): time advances only while a step runs, by the step's measured duration, and jumps
  over idle gaps to the next arrival. A replay runs as fast as the machine computes, and load is not
  distorted by the replay's own bookkeeping between steps.
- `cost`: like virtual, but a step lasts a fixed model time (`base + per_token x batched tokens`), so
  two runs of the same trace and settings produce identical timings: fully deterministic.
- `real`: the wall clock; the loop sleeps until arrivals (slow, but what a server would see).

Every request is greedy with `ignore_eos`, so its output length is exactly its `max_tokens` and every
policy does the same total work.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from tokenloop.bench.metrics import RequestRecord
from tokenloop.bench.trace import TraceRequest
from tokenloop.errors import TokenloopError
from tokenloop.observe.records import EngineObserver, StepRecord
from tokenloop.request import NS_PER_S, SamplingParams

if TYPE_CHECKING:
    from tokenloop.engine import LLMEngine
    from tokenloop.outputs import RequestOutput

CLOCK_MODES = ("virtual", "cost", "real")
# The simulator's runner moves the virtual clock itself (tokenloop.sim): nothing else may add time.
SIMULATED_CLOCK = "simulated"


class VirtualClock:
    """An integer-nanosecond clock that stands still between steps and jumps over idle time.

    Inside `step()` it runs at the speed of the real clock (measured mode). In cost mode (`step(cost=True)`)
    it stands still until the model forward, which moves it on by the step's modelled cost
    (`advance_by`): a request admitted in a step is stamped at the step's start and its tokens at the
    step's end, as on a real clock.
    """

    def __init__(self, start_ns: int = 0) -> None:
        self._now = start_ns
        self._anchor: int | None = None  # real time the running step began (measured mode)

    def __call__(self) -> int:
        if self._anchor is None:
            return self._now
        return self._now + (time.perf_counter_ns() - self._anchor)

    def advance_to(self, t_ns: int) -> None:
        """Jump forward (never back) to `t_ns`: nothing happens while the engine is idle."""
        self._now = max(self._now, t_ns)

    def advance_by(self, ns: int) -> None:
        self._now += ns

    @contextlib.contextmanager
    def step(self, cost: bool = False) -> Iterator[None]:
        """Let time run for one step: measured, or (cost) only as the forward advances it."""
        if cost:
            yield
            return
        self._anchor = time.perf_counter_ns()
        try:
            yield
        finally:
            self._now += time.perf_counter_ns() - self._anchor
            self._anchor = None


@dataclass(frozen=True)
class StepCost:
    """The cost clock's model time of one step: `base_ms + per_token_ms x batched tokens`."""

    base_ms: float = 10.0
    per_token_ms: float = 0.0

    def ns(self, num_batched_tokens: int) -> int:
        return int(round((self.base_ms + self.per_token_ms * num_batched_tokens) * 1e6))


@dataclass
class ReplayRecord:
    """One request's lifecycle in a replay (seconds from the trace's start)."""

    id: str
    arrival_s: float
    max_tokens: int
    priority: int = 0
    user: str | None = None
    prefix_id: str | None = None
    prompt_len: int = 0
    output_len: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: str = ""
    energy_j: float | None = None  # simulated runs with a powered profile: its share of the steps' energy

    @property
    def success(self) -> bool:
        return self.finish_reason in ("stop", "length") and self.first_token_s is not None

    @property
    def queue_wait_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2el_s(self) -> float | None:
        return None if self.last_token_s is None else self.last_token_s - self.arrival_s

    def to_request_record(self) -> RequestRecord:
        """As the client-side record the metrics are computed from (latencies count from arrival)."""
        return RequestRecord(success=self.success, prompt_len=self.prompt_len, output_len=self.output_len,
                             ttft_s=self.ttft_s or 0.0, itls_s=list(self.itls_s), e2el_s=self.e2el_s or 0.0,
                             start_s=self.arrival_s, error=self.error, request_id=self.id, priority=self.priority,
                             user=self.user, queue_wait_s=self.queue_wait_s)


@dataclass(frozen=True)
class TimelinePoint:
    """The engine's state after a step."""

    t_s: float
    num_running: int
    num_waiting: int
    kv_usage: float
    num_batched_tokens: int


@dataclass
class ReplayRun:
    """Everything one replay produced."""

    label: str
    kind: str  # "engine", "hf" or "server"
    records: list[ReplayRecord]
    timeline: list[TimelinePoint] = field(default_factory=list)
    admission_order: list[str] = field(default_factory=list)
    num_preemptions: int | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    num_steps: int = 0
    wall_s: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        """First arrival to last token (or finish) of any request."""
        ends = [r.last_token_s or r.finished_s for r in self.records if (r.last_token_s or r.finished_s) is not None]
        if not ends or not self.records:
            return 0.0
        return max(ends) - min(r.arrival_s for r in self.records)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        if self.prefix_cache_queries is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def record(self, request_id: str) -> ReplayRecord:
        return next(r for r in self.records if r.id == request_id)


def greedy_params(max_tokens: int) -> SamplingParams:
    """Every replayed request: greedy, exactly `max_tokens` tokens."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def new_record(request: TraceRequest, arrival_s: float) -> ReplayRecord:
    """A request's record as it arrives (at `arrival_s`, seconds since the replay's origin)."""
    return ReplayRecord(id=request.id, arrival_s=arrival_s, max_tokens=request.max_tokens,
                        priority=request.priority, user=request.user, prefix_id=request.prefix_id,
                        prompt_len=request.prompt_len_hint)


def fill_from_output(record: ReplayRecord, output: RequestOutput, origin_s: float) -> None:
    """A finished request's outcome and times (relative to `origin_s`) from its last output."""
    metrics = output.metrics
    completion = output.outputs[0]
    record.finish_reason = completion.finish_reason
    record.output_len = len(completion.token_ids)
    record.prompt_len = len(output.prompt_token_ids)
    if metrics is None:
        return

    def rel(t: float | None) -> float | None:
        return None if t is None else t - origin_s

    record.first_scheduled_s = rel(metrics.first_scheduled_time)
    record.first_token_s = rel(metrics.first_token_time)
    record.last_token_s = rel(metrics.last_token_time)
    record.finished_s = rel(metrics.finished_time)
    record.itls_s = list(metrics.itls_s)
    record.num_cached_tokens = metrics.num_cached_tokens
    record.num_preemptions = metrics.num_preemptions


def warm_up_engine(engine: LLMEngine, trace: Sequence[TraceRequest], num_requests: int = 4,
                   max_tokens: int = 4) -> None:
    """Run a few of the trace's prompts to completion on a throwaway engine, so one-time costs (allocator
    growth, kernel selection, lazy initialisation) do not land in whichever policy happens to run first."""
    for i, request in enumerate(trace[:num_requests]):
        try:
            engine.add_request(f"warmup-{i}", request.prompt, greedy_params(min(max_tokens, request.max_tokens)),
                               prompt_token_ids=request.prompt_tokens)
        except TokenloopError:
            continue  # a request the cache cannot hold fails in the replay proper; no need to warm it
    while engine.has_unfinished_requests():
        engine.step()


class _LastStep(EngineObserver):
    """What the last step ran, from its record (a step that ran nothing may leave none)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.num_scheduled = self.num_batched_tokens = 0
        self.record: StepRecord | None = None

    def on_step(self, record: StepRecord) -> None:
        self.num_scheduled, self.num_batched_tokens = record.num_scheduled, record.num_batched_tokens
        self.record = record


def replay_engine(trace: Sequence[TraceRequest], make_engine: Callable[[Callable[[], int]], LLMEngine], *,
                  label: str, clock_mode: str = "virtual", step_cost: StepCost | None = None,
                  time_scale: float = 1.0, progress: bool = True) -> ReplayRun:
    """Replay `trace` through a fresh engine built by `make_engine(clock)`; returns what happened."""
    if clock_mode not in (*CLOCK_MODES, SIMULATED_CLOCK):
        raise ValueError(f"unknown clock {clock_mode!r} (valid: {', '.join(CLOCK_MODES)})")
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    cost = step_cost or StepCost()
    replay = _EngineReplay(trace, make_engine, label, clock_mode, cost, time_scale, progress)
    engine, run = replay.engine, replay.run
    wall_start = time.perf_counter()
    while replay.pending or engine.has_unfinished_requests():
        replay.add_arrivals()
        if not engine.has_unfinished_requests():
            if replay.pending:
                replay.wait_for_next_arrival()
            continue
        replay.step()
    replay.bar.close()
    stats = engine.stats()
    run.records = [replay.records[r.id] for r in trace if r.id in replay.records]
    run.num_preemptions = stats.num_preemptions
    run.prefix_cache_queries = stats.prefix_cache_queries
    run.prefix_cache_hits = stats.prefix_cache_hits
    run.wall_s = time.perf_counter() - wall_start
    run.settings = {"clock": clock_mode, "time_scale": time_scale,
                    **({"step_cost_ms": [cost.base_ms, cost.per_token_ms]} if clock_mode == "cost" else {})}
    return run


class _EngineReplay:
    """One engine replay's state: the clock, the engine, the requests still to arrive, their records."""

    def __init__(self, trace: Sequence[TraceRequest], make_engine: Callable[[Callable[[], int]], LLMEngine],
                 label: str, clock_mode: str, cost: StepCost, time_scale: float, progress: bool) -> None:
        self.label, self.time_scale = label, time_scale
        self.virtual = clock_mode != "real"
        self.modelled = clock_mode in ("cost", SIMULATED_CLOCK)  # time passes only as the forward moves the clock
        self.vclock = VirtualClock()
        self.clock: Callable[[], int] = self.vclock if self.virtual else time.monotonic_ns
        self.engine = make_engine(self.clock)
        self.last_step = _LastStep()
        self.engine.add_observer(self.last_step)
        if clock_mode == "cost":  # the forward is where modelled time passes
            self.cost_the_forward(cost)
        self.origin_ns = self.clock()
        self.pending = deque(sorted(trace, key=lambda r: r.arrival_s))  # stable: file order among equal arrivals
        self.records: dict[str, ReplayRecord] = {}
        self.admitted: set[str] = set()
        self.run = ReplayRun(label=label, kind="engine", records=[])
        self.bar = tqdm(total=len(trace), desc=label, unit="req", disable=not progress, dynamic_ncols=True)

    def cost_the_forward(self, cost: StepCost) -> None:
        """Each forward advances the virtual clock by the cost model's time for its batched tokens."""
        forward = self.engine.runner.execute

        def costed_forward(output: Any) -> Any:
            result = forward(output)
            self.vclock.advance_by(cost.ns(output.num_batched_tokens))
            return result

        self.engine.runner.execute = costed_forward

    def arrival_ns(self, request: TraceRequest) -> int:
        return self.origin_ns + int(round(request.arrival_s * self.time_scale * NS_PER_S))

    def wait_for_next_arrival(self) -> None:
        wait_until(self.vclock if self.virtual else None, self.arrival_ns(self.pending[0]))

    def add_arrivals(self) -> None:
        """Add every request whose arrival time has passed; one the engine refuses is a failed request."""
        now = self.clock()
        while self.pending and self.arrival_ns(self.pending[0]) <= now:
            request = self.pending.popleft()
            arrival_ns = self.arrival_ns(request)
            record = self.records[request.id] = new_record(request, (arrival_ns - self.origin_ns) / NS_PER_S)
            try:
                self.engine.add_request(request.id, request.prompt, greedy_params(request.max_tokens),
                                        prompt_token_ids=request.prompt_tokens, priority=request.priority,
                                        user=request.user, arrival_ns=arrival_ns)
            except TokenloopError as exc:  # refused (too long for the cache...): a failed request
                record.error, record.finish_reason = str(exc), "error"
                self.bar.update(1)

    def step(self) -> None:
        """One engine step: admissions and finished requests noted, a timeline point appended."""
        self.last_step.reset()
        if self.virtual:
            with self.vclock.step(cost=self.modelled):
                outputs = self.engine.step()
        else:
            outputs = self.engine.step()
        if self.last_step.num_scheduled == 0:
            if not self.pending:
                raise RuntimeError(f"{self.label}: the engine holds requests but schedules none")
            self.wait_for_next_arrival()
            return
        self.run.num_steps += 1
        self.note_admissions(outputs, self.last_step.record)
        for output in outputs:
            if output.finished and output.request_id in self.records:
                fill_from_output(self.records[output.request_id], output, self.origin_ns / NS_PER_S)
                self.bar.update(1)
        stats = self.engine.stats()
        self.run.timeline.append(TimelinePoint((self.clock() - self.origin_ns) / NS_PER_S, stats.num_running,
                                               stats.num_waiting, stats.kv_usage, self.last_step.num_batched_tokens))

    def note_admissions(self, outputs: list[RequestOutput], record: StepRecord | None) -> None:
        """Append the requests this step admitted to the run's admission order."""
        # Running requests keep admission order; ones that finished within the step follow, in step order.
        # A running request not noted yet was admitted in this step (its admitted chunk, in admission
        # order, and no release: nothing admitted is preempted in the step it is admitted), so the step's
        # record names it without a pass over every running request.
        if record is None:
            running = [r.request_id for r in self.engine.scheduler.running_requests()]
        else:
            admitted_now = [c.request_id for c in record.scheduled if c.admitted]
            ended = {r.request_id for r in record.releases} if admitted_now and record.releases else ()
            running = [request_id for request_id in admitted_now if request_id not in ended]
        for request_id in running + [o.request_id for o in outputs]:
            if request_id not in self.admitted and request_id in self.records:
                self.admitted.add(request_id)
                self.run.admission_order.append(request_id)


def wait_until(vclock: VirtualClock | None, t_ns: int) -> None:
    """Idle until `t_ns`: a jump on the virtual clock, a sleep on the real one."""
    if vclock is not None:
        vclock.advance_to(t_ns)
    else:
        delay = (t_ns - time.monotonic_ns()) / NS_PER_S
        if delay > 0:
            time.sleep(delay)
