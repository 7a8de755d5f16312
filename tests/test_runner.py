"""ModelRunner: persistent block tables follow the scheduler's diffs; step tensors match a per-request build."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenloop.config import KVGroup, SchedulerConfig
from tokenloop.core.kv_cache import KVCacheManager
from tokenloop.core.scheduler import Scheduler
from tokenloop.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tokenloop.request import Request, RequestStatus, SamplingParams
from tokenloop.runner import BlockTables, ModelRunner

BLOCK_SIZE = 4
VOCAB = 11


@dataclass
class _CapturingModel:
    """Stands in for LlamaModel: records what the runner feeds the forward, returns rows of its indices."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    decode_kernel: Any = None
    prefill_kernel: Any = None
    last_weight_form: str = "fp32"
    calls: list[dict[str, Any]] = field(default_factory=list)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list:
        return []

    groups: tuple[KVGroup, ...] = (KVGroup(),)

    def kv_groups(self) -> tuple[KVGroup, ...]:
        return self.groups

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, kv_caches: list,
                logits_indices: torch.Tensor) -> torch.Tensor:
        self.calls.append({"input_ids": input_ids.tolist(), "positions": positions.tolist(),
                           "slots": meta.slot_mapping.tolist(), "query_start_loc": meta.query_start_loc,
                           "seq_lens": meta.seq_lens, "logits_indices": logits_indices.tolist(),
                           "table": meta.block_table.tolist()})
        return logits_indices.float().unsqueeze(1).expand(-1, VOCAB).clone()


def _request(rid: str, prompt_len: int, outputs: int, prompt_logprobs: int | None = None) -> Request:
    request = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(prompt_logprobs=prompt_logprobs), 0)
    for t in range(outputs):
        request.append_output_token(t % VOCAB)
    return request


def _reference(items: list[ScheduledRequest], tables: dict[str, list[int]]) -> dict[str, Any]:
    """The step tensors built request by request, as the runner once did."""
    input_ids, positions, slots, qsl, seq_lens, logits_rows = [], [], [], [0], [], []
    for item in items:
        start, n = item.num_computed_tokens, item.num_tokens
        input_ids += item.request.all_token_ids[start:start + n]
        table = tables[item.request_id]
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        base = qsl[-1]
        qsl.append(base + n)
        seq_lens.append(start + n)
        if item.request.sampling_params.prompt_logprobs is not None:
            last = min(start + n, item.request.num_prompt_tokens - 1)
            logits_rows += [base + p - start for p in range(start, last)]
        if item.samples:
            logits_rows.append(base + n - 1)
    return {"input_ids": input_ids, "positions": positions, "slots": slots, "query_start_loc": qsl,
            "seq_lens": seq_lens, "logits_indices": logits_rows}


def test_step_tensors_match_a_per_request_build_over_random_steps() -> None:
    rng = random.Random(0)
    model = _CapturingModel()
    runner = ModelRunner(model, num_blocks=10_000, block_size=BLOCK_SIZE)  # type: ignore[arg-type]
    tables: dict[str, list[int]] = {}
    live: dict[str, tuple[Request, int]] = {}  # request -> computed tokens
    next_block = 1
    for step in range(40):
        released = [rid for rid in live if rng.random() < 0.15]
        for rid in released:
            del live[rid], tables[rid]
        for i in range(rng.randint(0, 4)):
            rid = f"s{step}-{i}"
            live[rid] = (_request(rid, rng.randint(1, 30), 0, rng.choice([None, None, 2])), 0)
        items = []
        for rid, (request, computed) in list(live.items()):
            if computed == request.num_tokens:
                request.append_output_token(rng.randrange(VOCAB))
            n = min(request.num_tokens - computed, rng.randint(1, 9))
            needed = -(-(computed + n) // BLOCK_SIZE)
            admitted = rid not in tables
            have = tables.setdefault(rid, [])
            new = list(range(next_block, next_block + needed - len(have)))
            next_block += len(new)
            have += new
            items.append(ScheduledRequest(request, n, computed, computed + n == request.num_tokens, new,
                                          len(have), admitted))
            live[rid] = (request, computed + n)
        if not items:
            continue
        output = SchedulerOutput(scheduled=items, released_request_ids=released)
        runner.apply_block_diffs(output)
        result = runner.execute(output)
        runner.execute(output)  # a rerun of the same step (fault isolation) reads, never re-applies
        got, again = model.calls[-2], model.calls[-1]
        assert got == again
        want = _reference(items, tables)
        assert {k: got[k] for k in want} == want
        for row, item in enumerate(items):
            assert runner.block_table(item.request_id) == tables[item.request_id]
            assert got["table"][row][:len(tables[item.request_id])] == tables[item.request_id]
        assert result.sample_indices == [i for i, item in enumerate(items) if item.samples]
        qsl = want["query_start_loc"]
        assert result.logits[:, 0].tolist() == [qsl[i + 1] - 1 for i in result.sample_indices]
        for piece in result.prompt_logits:  # rows predicting prompt tokens first_target, first_target + 1, ...
            row = next(i for i, item in enumerate(items) if item.request_id == piece.request_id)
            first = qsl[row] + piece.first_target - 1 - items[row].num_computed_tokens
            assert piece.logits[:, 0].tolist() == list(range(first, first + piece.logits.shape[0]))


def test_block_tables_reuse_rows_and_grow() -> None:
    tables = BlockTables(num_rows=2, num_cols=2)
    a = tables.reset("a")
    tables.append(a, [5, 6, 7])  # wider than the array: columns grow
    b = tables.reset("b")
    tables.append(b, [1])
    c = tables.reset("c")  # no free row: rows grow
    tables.append(c, [9])
    assert (tables.get("a"), tables.get("b"), tables.get("c")) == ([5, 6, 7], [1], [9])
    tables.release("a")
    assert tables.get("a") == [] and not tables.table[a].any()  # a freed row is zeroed for the next user
    assert tables.reset("d") == a
    tables.append(tables.reset("b"), [4])  # re-admission empties its own row first
    assert tables.get("b") == [4]
    tables.release("missing")  # releasing an unknown request is a no-op


@dataclass
class _GroupsCapturingModel(_CapturingModel):
    """Keeps each step's layouts, one per KV group."""

    metas: list[Any] = field(default_factory=list)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, kv_caches: list,
                logits_indices: torch.Tensor) -> torch.Tensor:
        self.metas.append(meta)
        return logits_indices.float().unsqueeze(1).expand(-1, VOCAB).clone()


def test_every_kv_group_gets_its_own_table_slots_and_window() -> None:
    """Over the real scheduler and a full + sliding KV cache: each group's step layout addresses the blocks
    of that group's table, the sliding one with its window, and no slot is a released block's."""
    groups = (KVGroup("full"), KVGroup("sliding", 6))
    kv = KVCacheManager(64, BLOCK_SIZE, groups=groups)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=7, long_prefill_token_threshold=0), kv, 128)
    model = _GroupsCapturingModel(groups=groups)
    metas = model.metas
    runner = ModelRunner(model, num_blocks=64, block_size=BLOCK_SIZE)  # type: ignore[arg-type]
    requests = [_request("a", 30, 0), _request("b", 9, 0)]
    for request in requests:
        scheduler.add_request(request)
    released_seen = False  # the sliding group released what its window passed, while "a" ran
    for step in range(30):
        output = scheduler.schedule()
        if not output.scheduled:
            break
        runner.apply_block_diffs(output)
        runner.execute(output)
        full, sliding = metas[-1]
        assert (full.window, sliding.window) == (0, 6)
        position = 0
        for item in output.scheduled:
            for group, meta in enumerate((full, sliding)):
                table = kv.get_block_ids(item.request_id, group)
                # The runner's row holds the group's table, but for entries released since (never read).
                row = runner.block_table(item.request_id, group)
                assert all(mine == theirs for mine, theirs in zip(row, table) if theirs >= 0)
                for pos in range(item.num_computed_tokens, item.num_computed_tokens + item.num_tokens):
                    slot = meta.slot_mapping[position + pos - item.num_computed_tokens].item()
                    assert table[pos // BLOCK_SIZE] >= 0 and slot == table[pos // BLOCK_SIZE] * BLOCK_SIZE \
                        + pos % BLOCK_SIZE
            position += item.num_tokens
        scheduler.update_from_output(output)
        for item in output.scheduled:
            if item.samples:
                item.request.append_output_token(step % VOCAB)
                if item.request.num_output_tokens >= 6:
                    scheduler.finish_request(item.request_id, RequestStatus.FINISHED_LENGTH)
        released_seen = released_seen or any(b < 0 for b in kv.get_block_ids("a", 1))
    assert all(r.num_output_tokens >= 6 for r in requests) and released_seen
    kv.check_invariants([])
    assert kv.num_free_blocks == kv.num_blocks
