"""Replaying a trace through HF transformers with static batching: the baseline continuous batching beats.

When the model is idle, up to `batch_size` arrived requests are taken, prefilled together (left-padded) and
decoded until the longest is done; nobody joins a running batch. Each request's tokens are stamped when
produced, so a short request's E2EL ends at its own last token, but the next batch waits for the longest.
Time comes from the virtual or the real clock of `replay.py`.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from tokenloop.bench.replay import ReplayRecord, ReplayRun, TimelinePoint, VirtualClock, new_record, wait_until
from tokenloop.bench.trace import TraceRequest
from tokenloop.request import NS_PER_S

if TYPE_CHECKING:
    import torch

    from tokenloop.tokenizer import Tokenizer


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
    """Replay `trace` through `hf_model` in static batches of up to `batch_size` (the module's docstring)."""
    import torch

    if clock_mode == "cost":
        raise ValueError("the HF baseline has no step cost model: use the virtual or real clock")
    replay = _StaticBatchReplay(trace, hf_model, tokenizer, label, clock_mode != "real", time_scale, progress)
    with torch.inference_mode():
        replay.warm_up()
        wall_start = time.perf_counter()
        while replay.pending or replay.arrived:
            replay.take_arrivals()
            if not replay.arrived:
                replay.wait_for_next_arrival()
                continue
            replay.run_batch([replay.arrived.popleft() for _ in range(min(batch_size, len(replay.arrived)))])
    replay.bar.close()
    run = replay.run
    run.records = [replay.records[r.id] for r in trace if r.id in replay.records]
    run.wall_s = time.perf_counter() - wall_start
    run.settings = {"clock": clock_mode, "time_scale": time_scale, "batch_size": batch_size}
    return run


class _StaticBatchReplay:
    """One static-batching replay's state: the clock, the requests pending and arrived, their records."""

    def __init__(self, trace: Sequence[TraceRequest], hf_model: Any, tokenizer: Tokenizer, label: str,
                 virtual: bool, time_scale: float, progress: bool) -> None:
        self.trace, self.hf_model, self.tokenizer = trace, hf_model, tokenizer
        self.virtual, self.time_scale = virtual, time_scale
        self.vclock = VirtualClock()
        self.clock: Callable[[], int] = self.vclock if virtual else time.monotonic_ns
        self.origin_ns = self.clock()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.cache_arg = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
        self.pending = deque(sorted(trace, key=lambda r: r.arrival_s))
        self.arrived: deque[tuple[TraceRequest, list[int]]] = deque()
        self.records: dict[str, ReplayRecord] = {}
        self.run = ReplayRun(label=label, kind="hf", records=[])
        self.bar = tqdm(total=len(trace), desc=label, unit="req", disable=not progress, dynamic_ncols=True)

    def now_s(self) -> float:
        return (self.clock() - self.origin_ns) / NS_PER_S

    def arrival_ns(self, request: TraceRequest) -> int:
        return self.origin_ns + int(round(request.arrival_s * self.time_scale * NS_PER_S))

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        if self.virtual:
            with self.vclock.step():
                yield
        else:
            yield

    def encode(self, request: TraceRequest) -> list[int]:
        return list(request.prompt_tokens) if request.prompt_tokens is not None \
            else self.tokenizer.encode(request.prompt or "")

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.hf_model.config)

    def warm_up(self) -> None:
        """The first forwards pay one-time costs the replay should not."""
        import torch

        for request in self.trace[:2]:
            ids = torch.tensor([self.encode(request)])
            self.hf_model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1,
                          **{self.cache_arg: self.new_cache()})

    def take_arrivals(self) -> None:
        while self.pending and self.arrival_ns(self.pending[0]) <= self.clock():
            request = self.pending.popleft()
            self.records[request.id] = new_record(request, (self.arrival_ns(request) - self.origin_ns) / NS_PER_S)
            self.arrived.append((request, self.encode(request)))

    def wait_for_next_arrival(self) -> None:
        wait_until(self.vclock if self.virtual else None, self.arrival_ns(self.pending[0]))

    def run_batch(self, batch: list[tuple[TraceRequest, list[int]]]) -> None:
        """Prefill the batch together, left-padded, and decode until its longest request is done."""
        import torch

        start = self.now_s()
        width = max(len(ids) for _, ids in batch)
        input_ids = torch.tensor([[self.pad_id] * (width - len(ids)) + ids for _, ids in batch])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch])
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self.new_cache()
        batch_records = [self.records[request.id] for request, _ in batch]
        for record, (_, ids) in zip(batch_records, batch):
            record.first_scheduled_s, record.prompt_len = start, len(ids)
        for step in range(max(request.max_tokens for request, _ in batch)):
            with self.timed():
                out = self.hf_model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                    use_cache=True, logits_to_keep=1, **{self.cache_arg: cache})
                next_ids = out.logits[:, -1, :].argmax(dim=-1)
            self.run.num_steps += 1
            self.stamp_tokens(batch_records, step, mask)
            input_ids = next_ids[:, None]
            mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=mask.dtype)], dim=1)
            positions = positions[:, -1:] + 1

    def stamp_tokens(self, batch_records: list[ReplayRecord], step: int, mask: torch.Tensor) -> None:
        """One decode step's token for every unfinished request of the batch, and the step's timeline point."""
        t = self.now_s()
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
                    self.bar.update(1)
        # Requests that arrived during the batch are waiting too, though not yet taken off `pending`.
        now_ns = self.clock()
        waiting = len(self.arrived) + sum(1 for _ in itertools.takewhile(
            lambda r: self.arrival_ns(r) <= now_ns, self.pending))
        batched = int(mask.sum()) if step == 0 else len(batch_records)
        self.run.timeline.append(TimelinePoint(t, sum(r.output_len < r.max_tokens for r in batch_records),
                                               waiting, 0.0, batched))
