"""ModelRunner: owns the model's KV tensors and turns a SchedulerOutput into one batched forward.

It builds the step's flat tensors (`input_ids`, `positions`, `slot_mapping`, `query_start_loc`,
`seq_lens`, `block_table`, `logits_indices`) and returns logits only where something will be read:
the last position of each request that samples this step (every position of a row with speculative
drafts: its real token's and each draft's, to verify them), and every prompt position of a request
that asked for prompt logprobs.

Block tables live in one persistent `[rows, max blocks]` array per KV group (docs/kv-groups.md): a
request gets a row on admission, the scheduler's diffs append to it, and a release frees it. Each group
has its own slot mapping and `AttentionMetadata` a step; a sliding group's attends over its window only.
A step's tensors are then computed over the whole batch at once from a few per-request numbers, so a
step's cost does not grow with how long the requests' outputs are, beyond the block-table rows the
attention reads anyway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from operator import attrgetter, getitem

import numpy as np
import torch

from tokenloop.config import KVGroup
from tokenloop.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tokenloop.model.attention import AttentionMetadata
from tokenloop.model.lora_slots import AdapterSlots, LoRABatch
from tokenloop.model.models.llama import LlamaModel

# A step's per-row reads, done in C over the rows (ScheduledChunk fields, and the request's).
_REQUEST_ID, _START, _NUM_TOKENS, _SAMPLES = (attrgetter(name) for name in ("request_id", "start", "num_tokens",
                                                                             "samples"))
_TOKENS = attrgetter("request.all_token_ids")
_PROMPT_LOGPROBS = attrgetter("request.sampling_params.prompt_logprobs")


@dataclass
class PromptLogitsSlice:
    """Logits rows predicting prompt tokens [first_target, first_target + num_rows) of one request."""

    request_id: str
    first_target: int
    logits: torch.Tensor  # [num_rows, vocab]


@dataclass
class RunnerOutput:
    """Logits of the sampling rows, in the order of `sample_indices` into the step's scheduled list.

    A row with `d` draft tokens has `1 + d` consecutive logits rows: after its real token, then after each draft.
    """

    sample_indices: list[int]
    logits: torch.Tensor | None  # [len(sample_indices), vocab]; None when `token_ids` are given
    prompt_logits: list[PromptLogitsSlice] = field(default_factory=list)
    forward_s: float = 0.0  # time inside the model forward alone; the rest of execute is batch building
    weight_form: str = ""  # the form the projections ran in this step (int4, bfloat16, ...): rows decide
    # On CUDA the forward runs asynchronously: events around it, read once the step has synchronized anyway.
    forward_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    # A runner that decides the tokens itself (the simulator dictates the trace's) gives one per sampling
    # row here instead of logits: the step skips the sampler (no logprobs, no grammar masks).
    token_ids: list[int] | None = None

    @property
    def forward_seconds(self) -> float:
        """The forward's time: on CUDA measured on the device (waits for the forward's end if need be)."""
        if self.forward_events is None:
            return self.forward_s
        begin, end = self.forward_events
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


class BlockTables:
    """Every live request's block table as one row of a preallocated int64 array, grown on demand.

    Entries past a row's length are 0, so a step's table slice is valid padding without a fill.
    """

    def __init__(self, num_rows: int = 64, num_cols: int = 16) -> None:
        self.table = np.zeros((num_rows, num_cols), dtype=np.int64)
        self.lengths = np.zeros(num_rows, dtype=np.int64)
        self.rows: dict[str, int] = {}  # request id -> its row
        self._free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: low rows first

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is None:
            return
        self.table[row, :self.lengths[row]] = 0
        self.lengths[row] = 0
        self._free_rows.append(row)

    def reset(self, request_id: str) -> int:
        """An empty table for `request_id` (a new row, or its own row emptied); returns the row."""
        row = self.rows.get(request_id)
        if row is not None:
            self.table[row, :self.lengths[row]] = 0
            self.lengths[row] = 0
            return row
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self.rows[request_id] = row
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        start = int(self.lengths[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            self._grow_cols(end)
        self.table[row, start:end] = block_ids
        self.lengths[row] = end

    def get(self, request_id: str) -> list[int]:
        row = self.rows.get(request_id)
        return [] if row is None else self.table[row, :self.lengths[row]].tolist()

    def _grow_rows(self) -> None:
        old = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _grow_cols(self, needed: int) -> None:
        cols = self.table.shape[1]
        while cols < needed:
            cols *= 2
        grown = np.zeros((self.table.shape[0], cols), dtype=np.int64)
        grown[:, :self.table.shape[1]] = self.table
        self.table = grown


class ModelRunner:
    """Runs the model over the paged KV cache, one scheduler step at a time."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 adapters: AdapterSlots | None = None) -> None:
        self.model = model
        self.adapters = adapters  # the LoRA adapters served, and their resident slots
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = model.device
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)
        self.groups: tuple[KVGroup, ...] = model.kv_groups()
        self.group_tables = [BlockTables() for _ in self.groups]

    def apply_block_diffs(self, output: SchedulerOutput) -> None:
        """Bring the persistent block tables up to this step: drop released requests, append new blocks.

        Called once per step before `execute` (which may run more than once for one step when a forward
        fails and the engine isolates the culprit).
        """
        for group, tables in enumerate(self.group_tables):
            for request_id in output.released_request_ids:
                tables.release(request_id)
            rows = tables.rows
            for item in output.scheduled:
                chunk = item.chunk  # the row's plain values, read without its properties (every row, every step)
                new_ids = chunk.new_block_ids if item.group_block_ids is None else item.group_block_ids[group]
                if chunk.admitted:
                    tables.append(tables.reset(chunk.request_id), new_ids)
                elif new_ids:
                    tables.append(rows[chunk.request_id], new_ids)

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        return self.group_tables[group].get(request_id)

    # ---- one block's K/V as bytes, for a handoff ---------------------------------------------------

    @property
    def kv_layout(self) -> str:
        """What a block's bytes mean: dtype, layers, KV heads, head dim, and the KV groups when there are
        several (kind and window each: engines must agree to swap K/V)."""
        key = self.kv_caches[0][0]
        layout = f"{str(key.dtype).removeprefix('torch.')}:{len(self.kv_caches)}x{key.shape[2]}x{key.shape[3]}"
        if len(self.groups) > 1:
            layout += ":" + ",".join(f"{g.kind}{g.window or ''}" for g in self.groups)
        return layout

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes `read_block` returns per token slot."""
        key = self.kv_caches[0][0]
        return 2 * len(self.kv_caches) * key.shape[2] * key.shape[3] * key.element_size()

    def read_block(self, block_id: int, num_tokens: int) -> bytes:
        """K then V of every layer for the first `num_tokens` slots of a block, C order."""
        parts = [t[block_id, :num_tokens] for layer in self.kv_caches for t in layer]
        # Through uint8: numpy has no bfloat16.
        return torch.stack(parts).contiguous().view(torch.uint8).cpu().numpy().tobytes()

    def write_block(self, block_id: int, data: bytes, num_tokens: int) -> None:
        """The inverse of `read_block`: fill the first `num_tokens` slots of a block."""
        key = self.kv_caches[0][0]
        shape = (2 * len(self.kv_caches), num_tokens, key.shape[2], key.shape[3])
        values = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(key.dtype).reshape(shape)
        values = values.to(key.device)
        for i, (k, v) in enumerate(self.kv_caches):
            k[block_id, :num_tokens] = values[2 * i]
            v[block_id, :num_tokens] = values[2 * i + 1]

    @property
    def last_weight_form(self) -> str:
        """The form the last step's projections ran in (int4 / q8_0 for small batches, bf16 for large)."""
        return self.model.last_weight_form

    # long: it is the step's hot path, and its arrays are built once each.
    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """One batched forward over the step's rows: their tokens, positions and slots per KV group as host
        arrays (numpy, no per-token Python), sent to the device once; the logits of the rows that sample."""
        block_size = self.block_size
        scheduled = output.scheduled
        num_rows = len(scheduled)
        # The only per-request Python work: read three numbers of each row's record row (`chunk`, read in C
        # through attrgetter: a generator per array costs ~0.15 us a row) and this step's token ids.
        chunks = [item.chunk for item in scheduled]
        request_ids = list(map(_REQUEST_ID, chunks))
        starts = np.fromiter(map(_START, chunks), np.int64, num_rows)
        counts = np.fromiter(map(_NUM_TOKENS, chunks), np.int64, num_rows)
        query_start_loc, token_rows, positions = _flat_layout(starts, counts)
        decode = len(positions) == num_rows  # every row one token: no chunk, no draft
        input_ids = (list(map(getitem, map(_TOKENS, scheduled), starts.tolist())) if decode
                     else _step_token_ids(scheduled))
        seq_lens = starts + counts
        width = int((seq_lens.max() + block_size - 1) // block_size)
        # The same positions through each KV group's own blocks: its table rows and each token's slot.
        group_layouts = [_table_and_slots(tables, request_ids, token_rows, positions, width, block_size)
                         for tables in self.group_tables]

        sample_indices = np.flatnonzero(np.fromiter(map(_SAMPLES, chunks), np.bool_, num_rows))
        prompt_rows: list[tuple[str, int, int, int]] = []  # request id, first target, first row, count
        if list(map(_PROMPT_LOGPROBS, scheduled)).count(None) != num_rows:  # some row wants prompt logprobs
            logits_rows, prompt_rows = self._logits_rows_with_prompts(output, query_start_loc)
            logits_index = torch.tensor(logits_rows, dtype=torch.long)
        else:  # each sampling row's last token (in a decode step, the row itself)
            logits_index = torch.from_numpy(sample_indices if decode else query_start_loc[1:][sample_indices] - 1)
            if output.num_draft_tokens:
                logits_index = torch.from_numpy(_with_draft_rows(logits_index.numpy(), sample_indices, scheduled))

        # The step's metadata is host numbers (numpy); it goes to the device here, and nothing comes back.
        device = self.device
        host_starts, host_lens = torch.from_numpy(query_start_loc), torch.from_numpy(seq_lens)
        metas = [AttentionMetadata.build(host_starts, host_lens, torch.from_numpy(group_table).to(device),
                                         torch.from_numpy(group_slots).to(device), block_size,
                                         self.model.decode_kernel, self.model.prefill_kernel,
                                         window=group.window if group.kind == "sliding" else 0)
                 for group, (group_table, group_slots) in zip(self.groups, group_layouts)]
        meta = metas[0] if len(metas) == 1 else metas
        events = None
        if device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        lora = self._lora_batch(scheduled, token_rows) if self.adapters is not None else None
        begin = time.perf_counter()
        logits = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.from_numpy(positions).to(device), meta, self.kv_caches, logits_index.to(device),
            *(() if lora is None else (lora,)))
        logits = logits.float()  # stays on the model's device: the sampler works there
        forward_s = time.perf_counter() - begin
        if events is not None:
            events[1].record()

        prompt_logits: list[PromptLogitsSlice] = []
        if prompt_rows:
            logits, prompt_logits = _split_prompt_logits(logits, prompt_rows)
        return RunnerOutput(sample_indices.tolist(), logits, prompt_logits, forward_s, self.model.last_weight_form,
                            events)

    def _lora_batch(self, scheduled: list[ScheduledRequest], token_rows: np.ndarray) -> LoRABatch | None:
        """The step's adapter products: each token's adapter slot (loading adapters not resident), or None
        when every row runs the base model."""
        names = [item.request.lora_name for item in scheduled]
        if not any(names):
            return None
        assert self.adapters is not None
        slot_of = self.adapters.slots_for(name for name in names if name is not None)
        row_slots = np.fromiter((-1 if name is None else slot_of[name] for name in names), np.int64,
                                len(names))
        return self.adapters.batch(row_slots[token_rows])

    @staticmethod
    def _logits_rows_with_prompts(output: SchedulerOutput, query_start_loc: np.ndarray,
                                  ) -> tuple[list[int], list[tuple[str, int, int, int]]]:
        """Logits rows when some request wants prompt logprobs: its prompt rows, then its sample row, per
        request in batch order (the order the forward has always selected them in)."""
        logits_rows: list[int] = []
        prompt_rows: list[tuple[str, int, int, int]] = []
        for row, item in enumerate(output.scheduled):
            request = item.request
            start, n = item.num_computed_tokens, item.num_tokens
            base = int(query_start_loc[row])
            if request.sampling_params.prompt_logprobs is not None:
                # Rows of this chunk whose next token is a prompt token (positions start .. num_prompt - 2).
                targets = range(start, min(start + n, request.num_prompt_tokens - 1))
                num = len(targets)
                if num:
                    prompt_rows.append((request.request_id, targets.start + 1, len(logits_rows), num))
                    logits_rows.extend(range(base, base + num))
            if item.samples:
                logits_rows.extend(range(base + n - 1 - len(item.draft_token_ids), base + n))
        return logits_rows, prompt_rows


def _with_draft_rows(last_rows: np.ndarray, sample_indices: np.ndarray, scheduled: list[ScheduledRequest],
                     ) -> np.ndarray:
    """Each sampling row's last position, widened to its 1 + d positions when it carries d drafts."""
    drafts = np.fromiter((len(scheduled[i].draft_token_ids) for i in sample_indices), np.int64, len(sample_indices))
    counts = drafts + 1
    first = last_rows - drafts
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(first, counts) + offsets


def _table_and_slots(tables: BlockTables, request_ids: list[str], token_rows: np.ndarray, positions: np.ndarray,
                     width: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """One KV group's block-table rows of the step's requests ([B, width]) and each flat token's slot [T]."""
    rows = np.fromiter(map(tables.rows.__getitem__, request_ids), np.int64, len(request_ids))
    table = tables.table[rows, :width]
    return table, table[token_rows, positions // block_size] * block_size + positions % block_size


def _flat_layout(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's flat token layout from each row's first position and token count: (query_start_loc
    [B+1], each token's row [T], each token's position [T])."""
    num_rows = len(starts)
    query_start_loc = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    if query_start_loc[-1] == num_rows:  # a decode step: token i is row i's one token, at its start
        return query_start_loc, query_start_loc[:-1], starts
    # Position of each flat token: its index minus where its request's run starts, plus its start.
    token_rows = np.repeat(np.arange(num_rows), counts)
    shift = starts - query_start_loc[:-1]
    return query_start_loc, token_rows, np.arange(int(query_start_loc[-1]), dtype=np.int64) + shift[token_rows]


def _step_token_ids(scheduled: list[ScheduledRequest]) -> list[int]:
    """The step's input ids, row after row: a decode row's one token, a chunk's tokens, or one real token
    followed by the drafts it verifies."""
    input_ids: list[int] = []
    for item in scheduled:
        tokens = item.request.all_token_ids
        start = item.num_computed_tokens
        if item.num_tokens == 1:
            input_ids.append(tokens[start])
        elif item.draft_token_ids:  # one real token, then the drafts to verify
            input_ids.append(tokens[start])
            input_ids.extend(item.draft_token_ids)
        else:
            input_ids.extend(tokens[start:start + item.num_tokens])
    return input_ids


def _split_prompt_logits(logits: torch.Tensor, prompt_rows: list[tuple[str, int, int, int]],
                         ) -> tuple[torch.Tensor, list[PromptLogitsSlice]]:
    """Separate the prompt-logprob rows (request id, first target, first row, count) from the rows that
    sample: (the sampling rows' logits, each request's prompt slice)."""
    prompt_logits = [PromptLogitsSlice(rid, first, logits[at:at + count]) for rid, first, at, count in prompt_rows]
    keep = np.ones(logits.shape[0], dtype=np.bool_)
    for _, _, at, count in prompt_rows:
        keep[at:at + count] = False
    sample_rows = torch.from_numpy(np.flatnonzero(keep)).to(logits.device)  # by index: a mask would sync
    return logits.index_select(0, sample_rows), prompt_logits
