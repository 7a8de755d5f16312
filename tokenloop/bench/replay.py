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
import inspect
import itertools
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
    from tokenloop.tokenizer import Tokenizer

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


def _new_record(request: TraceRequest, arrival_s: float) -> ReplayRecord:
    return ReplayRecord(id=request.id, arrival_s=arrival_s, max_tokens=request.max_tokens,
                        priority=request.priority, user=request.user, prefix_id=request.prefix_id,
                        prompt_len=request.prompt_len_hint)


def _fill_from_output(record: ReplayRecord, output: RequestOutput, origin_s: float) -> None:
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
    virtual = clock_mode != "real"
    modelled = clock_mode in ("cost", SIMULATED_CLOCK)  # time passes only as the forward moves the clock
    vclock = VirtualClock()
    clock: Callable[[], int] = vclock if virtual else time.monotonic_ns
    engine = make_engine(clock)
    last_step = _LastStep()
    engine.add_observer(last_step)
    cost = step_cost or StepCost()
    if clock_mode == "cost":  # the forward is where modelled time passes
        forward = engine.runner.execute

        def costed_forward(output: Any) -> Any:
            result = forward(output)
            vclock.advance_by(cost.ns(output.num_batched_tokens))
            return result

        engine.runner.execute = costed_forward

    origin_ns = clock()
    pending = deque(sorted(trace, key=lambda r: r.arrival_s))  # stable: file order among equal arrivals
    records: dict[str, ReplayRecord] = {}
    admitted: set[str] = set()
    run = ReplayRun(label=label, kind="engine", records=[])
    bar = tqdm(total=len(trace), desc=label, unit="req", disable=not progress, dynamic_ncols=True)
    wall_start = time.perf_counter()

    def arrival_ns(request: TraceRequest) -> int:
        return origin_ns + int(round(request.arrival_s * time_scale * NS_PER_S))

    def note_admissions(outputs: list[RequestOutput], record: StepRecord | None) -> None:
        # Running requests keep admission order; ones that finished within the step follow, in step order.
        # A running request not noted yet was admitted in this step (its admitted chunk, in admission
        # order, and no release: nothing admitted is preempted in the step it is admitted), so the step's
        # record names it without a pass over every running request.
        if record is None:
            running = [r.request_id for r in engine.scheduler.running_requests()]
        else:
            admitted_now = [c.request_id for c in record.scheduled if c.admitted]
            ended = {r.request_id for r in record.releases} if admitted_now and record.releases else ()
            running = [request_id for request_id in admitted_now if request_id not in ended]
        for request_id in running + [o.request_id for o in outputs]:
            if request_id not in admitted and request_id in records:
                admitted.add(request_id)
                run.admission_order.append(request_id)

    while pending or engine.has_unfinished_requests():
        now = clock()
        while pending and arrival_ns(pending[0]) <= now:
            request = pending.popleft()
            record = records[request.id] = _new_record(request, (arrival_ns(request) - origin_ns) / NS_PER_S)
            try:
                engine.add_request(request.id, request.prompt, greedy_params(request.max_tokens),
                                   prompt_token_ids=request.prompt_tokens, priority=request.priority,
                                   user=request.user, arrival_ns=arrival_ns(request))
            except TokenloopError as exc:  # refused (too long for the cache...): a failed request
                record.error, record.finish_reason = str(exc), "error"
                bar.update(1)
        if not engine.has_unfinished_requests():
            if pending:
                _wait_until(vclock if virtual else None, arrival_ns(pending[0]))
            continue
        last_step.reset()
        if virtual:
            with vclock.step(cost=modelled):
                outputs = engine.step()
        else:
            outputs = engine.step()
        if last_step.num_scheduled == 0:
            if not pending:
                raise RuntimeError(f"{label}: the engine holds requests but schedules none")
            _wait_until(vclock if virtual else None, arrival_ns(pending[0]))
            continue
        run.num_steps += 1
        note_admissions(outputs, last_step.record)
        for output in outputs:
            if output.finished and output.request_id in records:
                _fill_from_output(records[output.request_id], output, origin_ns / NS_PER_S)
                bar.update(1)
        stats = engine.stats()
        run.timeline.append(TimelinePoint((clock() - origin_ns) / NS_PER_S, stats.num_running, stats.num_waiting,
                                          stats.kv_usage, last_step.num_batched_tokens))
    bar.close()
    stats = engine.stats()
    run.records = [records[r.id] for r in trace if r.id in records]
    run.num_preemptions = stats.num_preemptions
    run.prefix_cache_queries = stats.prefix_cache_queries
    run.prefix_cache_hits = stats.prefix_cache_hits
    run.wall_s = time.perf_counter() - wall_start
    run.settings = {"clock": clock_mode, "time_scale": time_scale,
                    **({"step_cost_ms": [cost.base_ms, cost.per_token_ms]} if clock_mode == "cost" else {})}
    return run


def _wait_until(vclock: VirtualClock | None, t_ns: int) -> None:
    """Idle until `t_ns`: a jump on the virtual clock, a sleep on the real one."""
    if vclock is not None:
        vclock.advance_to(t_ns)
    else:
        delay = (t_ns - time.monotonic_ns()) / NS_PER_S
        if delay > 0:
            time.sleep(delay)


# ---- HF transformers static batching ------------------------------------------------------------

def load_hf_model(model: str) -> Any:
    """The model through HF transformers in fp32 (GGUF via `gguf_file`, or a checkpoint directory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenloop.model.loader import resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir():
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return hf.eval()


def replay_hf_static(trace: Sequence[TraceRequest], hf_model: Any, tokenizer: Tokenizer, *, batch_size: int,
                     label: str = "hf-static", clock_mode: str = "virtual", time_scale: float = 1.0,
                     progress: bool = True) -> ReplayRun:
    """Static batching, the baseline continuous batching beats: when the model is idle, take up to
    `batch_size` arrived requests, prefill them together (left-padded) and decode until the longest is
    done; nobody joins a running batch. Each request's tokens are stamped when produced, so a short
    request's E2EL ends at its own last token, but the next batch waits for the longest.
    """
    import torch

    if clock_mode == "cost":
        raise ValueError("the HF baseline has no step cost model: use the virtual or real clock")
    virtual = clock_mode != "real"
    vclock = VirtualClock()
    clock: Callable[[], int] = vclock if virtual else time.monotonic_ns
    origin_ns = clock()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    cache_arg = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    from transformers import DynamicCache

    def now_s() -> float:
        return (clock() - origin_ns) / NS_PER_S

    def arrival_ns(request: TraceRequest) -> int:
        return origin_ns + int(round(request.arrival_s * time_scale * NS_PER_S))

    @contextlib.contextmanager
    def timed() -> Iterator[None]:
        if virtual:
            with vclock.step():
                yield
        else:
            yield

    def encode(request: TraceRequest) -> list[int]:
        return list(request.prompt_tokens) if request.prompt_tokens is not None \
            else tokenizer.encode(request.prompt or "")

    with torch.inference_mode():  # warm-up: the first forwards pay one-time costs the replay should not
        for request in trace[:2]:
            ids = torch.tensor([encode(request)])
            hf_model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1,
                     **{cache_arg: DynamicCache(config=hf_model.config)})

    pending = deque(sorted(trace, key=lambda r: r.arrival_s))
    arrived: deque[tuple[TraceRequest, list[int]]] = deque()
    records: dict[str, ReplayRecord] = {}
    run = ReplayRun(label=label, kind="hf", records=[])
    bar = tqdm(total=len(trace), desc=label, unit="req", disable=not progress, dynamic_ncols=True)
    wall_start = time.perf_counter()
    with torch.inference_mode():
        while pending or arrived:
            while pending and arrival_ns(pending[0]) <= clock():
                request = pending.popleft()
                records[request.id] = _new_record(request, (arrival_ns(request) - origin_ns) / NS_PER_S)
                arrived.append((request, encode(request)))
            if not arrived:
                _wait_until(vclock if virtual else None, arrival_ns(pending[0]))
                continue
            batch = [arrived.popleft() for _ in range(min(batch_size, len(arrived)))]
            start = now_s()
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for _, ids in batch])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch])
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            cache = DynamicCache(config=hf_model.config)
            batch_records = [records[request.id] for request, _ in batch]
            for record, (_, ids) in zip(batch_records, batch):
                record.first_scheduled_s, record.prompt_len = start, len(ids)
            longest = max(request.max_tokens for request, _ in batch)
            for step in range(longest):
                with timed():
                    out = hf_model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                   use_cache=True, logits_to_keep=1, **{cache_arg: cache})
                    next_ids = out.logits[:, -1, :].argmax(dim=-1)
                run.num_steps += 1
                t = now_s()
                for record in batch_records:
                    if record.output_len < record.max_tokens:
                        if record.first_token_s is None:
                            record.first_token_s = t
                        else:
                            record.itls_s.append(t - (record.last_token_s or t))
                        record.last_token_s = t
                        record.output_len += 1
                        if record.output_len == record.max_tokens:
                            record.finished_s, record.finish_reason = t, "length"
                            bar.update(1)
                # Requests that arrived during the batch are waiting too, though not yet taken off `pending`.
                now_ns = clock()
                waiting = len(arrived) + sum(1 for _ in itertools.takewhile(
                    lambda r, now_ns=now_ns: arrival_ns(r) <= now_ns, pending))
                batched = int(mask.sum()) if step == 0 else len(batch)
                run.timeline.append(TimelinePoint(t, sum(r.output_len < r.max_tokens for r in batch_records),
                                                  waiting, 0.0, batched))
                input_ids = next_ids[:, None]
                mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=mask.dtype)], dim=1)
                positions = positions[:, -1:] + 1
    bar.close()
    run.records = [records[r.id] for r in trace if r.id in records]
    run.wall_s = time.perf_counter() - wall_start
    run.settings = {"clock": clock_mode, "time_scale": time_scale, "batch_size": batch_size}
    return run
