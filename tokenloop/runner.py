"""ModelRunner: owns the model's KV tensors and turns a SchedulerOutput into one batched forward.

It builds the step's flat tensors (`input_ids`, `positions`, `slot_mapping`, `query_start_loc`,
`seq_lens`, `block_table`, `logits_indices`) and returns logits only where something will be read:
the last position of each request that samples this step, and every prompt position of a request
that asked for prompt logprobs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tokenloop.core.scheduler import SchedulerOutput
from tokenloop.model.attention import AttentionMetadata
from tokenloop.model.llama import LlamaModel


@dataclass
class PromptLogitsSlice:
    """Logits rows predicting prompt tokens [first_target, first_target + num_rows) of one request."""

    request_id: str
    first_target: int
    logits: torch.Tensor  # [num_rows, vocab]


@dataclass
class RunnerOutput:
    """Logits of the sampling rows, in the order of `sample_indices` into the step's scheduled list."""

    sample_indices: list[int]
    logits: torch.Tensor  # [len(sample_indices), vocab]
    prompt_logits: list[PromptLogitsSlice] = field(default_factory=list)
    forward_s: float = 0.0  # time inside the model forward alone; the rest of execute is batch building
    weight_form: str = ""  # the form the projections ran in this step (int4, bfloat16, ...): rows decide


class ModelRunner:
    """Runs the model over the paged KV cache, one scheduler step at a time."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = model.device
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)
        self._tables: dict[str, list[int]] = {}  # request id -> its block table, kept up to date by diffs

    def apply_block_diffs(self, output: SchedulerOutput) -> None:
        """Bring the persistent block tables up to this step: drop released requests, append new blocks.

        Called once per step before `execute` (which may run more than once for one step when a forward
        fails and the engine isolates the culprit).
        """
        tables = self._tables
        for request_id in output.released_request_ids:
            tables.pop(request_id, None)
        for item in output.scheduled:
            if item.admitted:
                tables[item.request_id] = list(item.new_block_ids)
            elif item.new_block_ids:
                tables[item.request_id].extend(item.new_block_ids)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    @property
    def last_weight_form(self) -> str:
        """The form the last step's projections ran in (int4 / q8_0 for small batches, bf16 for large)."""
        return self.model.last_weight_form

    def _prompt_logit_rows(self, start: int, n: int, num_prompt: int) -> range:
        """Rows of this chunk whose next token is a prompt token (positions start .. num_prompt - 2)."""
        return range(start, min(start + n, num_prompt - 1))

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sample_indices: list[int] = []
        prompt_rows: list[tuple[str, int, int, int]] = []  # request id, first target, first row, count
        tables = [self._tables[item.request_id] for item in output.scheduled]
        width = max(len(t) for t in tables)
        table = torch.zeros(len(output.scheduled), width, dtype=torch.long)

        for row, item in enumerate(output.scheduled):
            request = item.request
            start, n = item.num_computed_tokens, item.num_tokens
            end = start + n
            input_ids.extend(request.all_token_ids[start:end])
            blocks = torch.tensor(tables[row], dtype=torch.long)
            table[row, :len(blocks)] = blocks
            pos = torch.arange(start, end)
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
            base = query_start_loc[-1]
            query_start_loc.append(base + n)
            seq_lens.append(end)
            wanted = request.sampling_params.prompt_logprobs
            if wanted is not None:
                rows = self._prompt_logit_rows(start, n, request.num_prompt_tokens)
                if len(rows):
                    prompt_rows.append((request.request_id, rows.start + 1, len(logits_rows), len(rows)))
                    logits_rows.extend(base + p - start for p in rows)
            if item.samples:
                sample_indices.append(row)
                logits_rows.append(base + n - 1)

        meta = AttentionMetadata.build(query_start_loc, seq_lens, table.to(self.device),
                                       torch.cat(slots).to(self.device), block_size, self.model.decode_kernel)
        begin = time.perf_counter()
        logits = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.cat(positions).to(self.device), meta, self.kv_caches,
            torch.tensor(logits_rows, dtype=torch.long, device=self.device))
        logits = logits.float().cpu()  # the sampler works on the host; a no-op for a CPU model
        forward_s = time.perf_counter() - begin

        prompt_logits = [PromptLogitsSlice(rid, first, logits[at:at + count])
                         for rid, first, at, count in prompt_rows]
        keep = torch.ones(len(logits_rows), dtype=torch.bool)
        for _, _, at, count in prompt_rows:
            keep[at:at + count] = False
        return RunnerOutput(sample_indices, logits[keep.to(logits.device)] if prompt_rows else logits,
                            prompt_logits, forward_s, self.model.last_weight_form)
