"""What one step computes, as the scheduler hands it on: `SchedulerOutput` and its `ScheduledRequest` rows.

This is the boundary between the scheduler and the stages after it (the runner, the isolation of failures,
the update, the records, the simulator): they read the step's rows and block-table diffs here and never the
scheduler's queues. The scheduler (`core/scheduler.py`) builds one per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenloop.observe.records import ScheduledChunk
from tokenloop.request import Request


class ScheduledRequest:
    """One request's share of a step: tokens at positions [num_computed_tokens, + num_tokens).

    Block tables travel as diffs: `new_block_ids` are appended to the request's table this step. On an
    admission (or a resume after preemption) the table starts empty, so they are the whole table: the
    `num_reused_blocks` prefix-hit blocks first, then the blocks taken for new tokens.

    Its plain values are the step record's row (`chunk`, a `ScheduledChunk`), built once here and handed
    to the record as they are: one object per row per step instead of two (issue 13's speed goal). The
    fields below read and write through it. `new_block_ids` are group 0's; with more KV groups
    (docs/kv-groups.md), `group_block_ids` holds the same diff for every group (-1: a position a sliding
    window has passed, on an admission after a prefix hit).
    """

    __slots__ = ("chunk", "draft_token_ids", "group_block_ids", "request")

    def __init__(self, request: Request, num_tokens: int, num_computed_tokens: int, samples: bool,
                 new_block_ids: list[int], num_blocks: int, admitted: bool = False, num_reused_blocks: int = 0,
                 prefix_hit_tokens: int = 0, draft_token_ids: Sequence[int] = ()) -> None:
        """`num_computed_tokens`: the request's computed tokens when scheduled (the first position to
        compute); `samples`: the step reaches the end of its known tokens, so it samples the next one;
        `num_blocks`: blocks in its table after this step's allocation; `admitted`: its first allocation
        since it held no blocks (admitted or resumed)."""
        self.request = request
        self.chunk = ScheduledChunk(request.request_id, num_computed_tokens, num_tokens,
                                    len(request.prompt_token_ids), samples, new_block_ids, num_reused_blocks,
                                    prefix_hit_tokens, admitted, num_blocks)
        # Speculative tokens after the request's last one, counted in num_tokens (their K/V slots are
        # allocated); only a decoding row (one real token, samples) gets them.
        self.draft_token_ids = draft_token_ids
        self.group_block_ids: list[list[int]] | None = None  # set once the step is scheduled, if > 1 group

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return self.chunk.num_tokens

    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        self.chunk.num_tokens = value

    @property
    def num_computed_tokens(self) -> int:
        return self.chunk.start

    @property
    def samples(self) -> bool:
        return self.chunk.samples

    @property
    def new_block_ids(self) -> list[int]:
        return self.chunk.new_block_ids

    @property
    def num_blocks(self) -> int:
        return self.chunk.num_blocks

    @num_blocks.setter
    def num_blocks(self, value: int) -> None:
        self.chunk.num_blocks = value

    @property
    def admitted(self) -> bool:
        return self.chunk.admitted

    @property
    def num_reused_blocks(self) -> int:
        return self.chunk.num_reused_blocks

    @property
    def prefix_hit_tokens(self) -> int:
        return self.chunk.prefix_hit_tokens

    def __repr__(self) -> str:
        return f"ScheduledRequest({self.chunk!r}, drafts={list(self.draft_token_ids)})"


@dataclass
class SchedulerOutput:
    """What one step computes."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # ended with an error while being scheduled
    num_batched_tokens: int = 0
    # Requests whose block tables are gone since the last schedule (finished, aborted, preempted), so a
    # runner keeping persistent tables drops their rows before this step's diffs are applied.
    released_request_ids: list[str] = field(default_factory=list)
    kv_ns: int = 0  # time spent in KV lookups and allocations inside schedule()
    num_draft_tokens: int = 0  # speculative tokens among num_batched_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
