"""The engine core's records, built from what a step's stages returned (tokenloop.observe.records)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenloop.core.kv_cache import BlockRelease, KVCacheManager
from tokenloop.core.scheduler import Scheduler
from tokenloop.core.scheduler_output import SchedulerOutput
from tokenloop.observe.records import ReleaseInfo, StepGauges, StepRecord
from tokenloop.request import Request
from tokenloop.runner import RunnerOutput


def release_infos(releases: Sequence[tuple[Request, BlockRelease, int, int]]) -> list[ReleaseInfo]:
    """The scheduler's releases (request, what its blocks became, start and end ns) as records."""
    infos = []
    for request, release, start, end in releases:
        t = request.times
        infos.append(ReleaseInfo(
            request.request_id, request.status, request.finish_reason, request.stop_reason,
            request.error, release.block_ids, release.num_freed, release.num_kept_cached,
            release.num_still_shared, start, end, t.arrival, t.first_scheduled, t.first_token, t.last_token,
            t.finished if t.finished is not None else start, request.num_prompt_tokens,
            request.num_output_tokens, request.num_cached_tokens, request.num_preemptions))
    return infos


def gauges(scheduler: Scheduler, kv: KVCacheManager) -> StepGauges:
    return StepGauges(
        scheduler.num_running, scheduler.num_waiting, scheduler.num_preempted_waiting, kv.num_blocks,
        kv.block_size, kv.num_free_blocks, kv.pool.num_cached_free, kv.prefix_cache_queries,
        kv.prefix_cache_hits, kv.evictions, scheduler.num_preemptions)


def step_record(index: int, times: Sequence[int], schedule: SchedulerOutput, result: RunnerOutput | None,
                sampled: Sequence[tuple[Request, int, object]], releases: list[ReleaseInfo],
                gauges: StepGauges, num_accepted_tokens: int = 0) -> StepRecord:
    """`times`: start, schedule end, execute end, sample end, end (engine-clock ns); `sampled`: the tokens
    appended (a speculative row's accepted drafts and next token included)."""
    start, schedule_end, execute_end, sample_end, end = times
    # Each scheduled row's plain values are already a ScheduledChunk (ScheduledRequest.chunk).
    chunks = [item.chunk for item in schedule.scheduled]
    return StepRecord(
        index, start, schedule_end, execute_end, sample_end, end, schedule.kv_ns,
        int(result.forward_seconds * 1e9) if result is not None else 0, sum(r.end_ns - r.start_ns for r in releases),
        schedule.num_batched_tokens, chunks, [r.request_id for r in schedule.preempted],
        [r.request_id for r, _, _ in sampled], [t for _, t, _ in sampled], releases, gauges,
        result.weight_form if result is not None else "",
        num_draft_tokens=schedule.num_draft_tokens if result is not None else 0,
        num_accepted_tokens=num_accepted_tokens)
