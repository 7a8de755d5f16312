"""The engine's present, rebuilt from its records: live requests and the queue / pool gauges.

An observer that shows "now" (the dashboard, the Prometheus gauges) keeps a `LiveState`: arrivals add a
row, steps move rows between waiting, running and preempted, releases remove them. The gauges are the
last `StepRecord`'s, corrected for what happened since: an arrival's queue length, and the blocks and
queue slots a request aborted between steps gave back (an idle engine takes no step that would say so).
Not thread-safe: its owner feeds it on the observer thread and copies it under its own lock.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenloop.observe.records import ArrivalRecord, ReleaseInfo, StepGauges, StepRecord
from tokenloop.request import RequestStatus

WAITING, RUNNING, PREEMPTED = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED


@dataclass(slots=True)
class LiveRequest:
    """One live request as its records tell it (times on the engine clock, ns)."""

    request_id: str
    arrival_ns: int
    num_prompt_tokens: int
    state: RequestStatus = WAITING
    first_scheduled_ns: int | None = None  # the start of the first step that scheduled it
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens from the prefix cache at its first admission
    num_preemptions: int = 0


@dataclass
class LiveState:
    """Live requests by id and the current gauges (None until the first step)."""

    rows: dict[str, LiveRequest] = field(default_factory=dict)
    gauges: StepGauges | None = None
    # Between steps only arrivals move the queue length; kept apart so the last step's gauges stay intact.
    _num_waiting: int | None = None

    def arrival(self, record: ArrivalRecord) -> None:
        self.rows[record.request_id] = LiveRequest(record.request_id, record.arrival_ns,
                                                   len(record.prompt_token_ids))
        self._num_waiting = record.num_waiting
        if self.gauges is not None:
            self.gauges.num_waiting = record.num_waiting

    def step(self, record: StepRecord) -> list[LiveRequest]:
        """Apply one step; returns the rows that got their first token in it."""
        # A copy: the record may be shared with other observers, and release() below adjusts ours.
        self.gauges = dataclasses.replace(record.gauges)
        rows = self.rows
        for request_id in record.preempted:
            row = rows.get(request_id)
            if row is not None:
                row.state = PREEMPTED
                row.num_preemptions += 1
        for chunk in record.scheduled:
            row = rows.get(chunk.request_id)
            if row is None:
                continue  # arrived before its owner started watching
            if row.first_scheduled_ns is None:
                row.first_scheduled_ns = record.start_ns
                row.num_cached_tokens = chunk.prefix_hit_tokens
            row.state = RUNNING
        sample_ns = record.sample_end_ns
        firsts = []
        for request_id in record.sampled_ids:
            row = rows.get(request_id)
            if row is not None:
                row.num_output_tokens += 1
                row.last_token_ns = sample_ns
                if row.first_token_ns is None:
                    row.first_token_ns = sample_ns
                    firsts.append(row)
        for info in record.releases:
            rows.pop(info.request_id, None)
        return firsts

    def release(self, infos: list[ReleaseInfo]) -> None:
        """Requests that ended between steps: their queue slot and blocks come back now."""
        gauges = self.gauges
        for info in infos:
            row = self.rows.pop(info.request_id, None)
            if row is None:
                continue
            if gauges is None:  # before the first step only arrivals have been counted
                self._num_waiting = max(0, (self._num_waiting or 0) - 1)
                continue
            if row.state == RUNNING:
                gauges.num_running -= 1
            else:
                gauges.num_waiting -= 1
                if row.state == PREEMPTED:
                    gauges.num_preempted_waiting -= 1
            # Blocks whose last reference went come back to the free queue; shared ones stay referenced.
            gauges.num_free_blocks += info.num_freed + info.num_kept_cached
            gauges.num_cached_free_blocks += info.num_kept_cached

    def num_waiting(self) -> int:
        """The queue's length as last reported (by a step or an arrival)."""
        if self.gauges is not None:
            return self.gauges.num_waiting
        return self._num_waiting or 0

    def clear(self) -> None:
        """Forget the rows (their owner stops watching; it cannot follow them any more)."""
        self.rows.clear()
