"""The scheduler: which requests get how many tokens this step, under a token budget and a sequence cap.

There are no prefill and decode phases. Every request has `num_computed_tokens` and catches up towards
`num_tokens`; each step gives it at most the tokens it has left and the budget left, so a long
prompt is computed in chunks over several steps while other requests keep decoding. Running requests are
served first, in policy order, then waiting ones are admitted in policy order. A running request that
cannot get blocks preempts (by recompute) the running request the policy ranks last; a waiting request
never preempts anyone: when it does not fit, admission stops for the step.

Long prompts never starve short requests (issue 28). A request with more than the long-prefill threshold
of tokens left (half the budget by default) is a long prefill: it gets at most the threshold until everyone
else has had their turn, and at most `max_long_partial_prefills` of them are in progress at once; a waiting
long prefill beyond that keeps its place but lets the shorter requests behind it be admitted. What budget is
left at the end goes back to the long prefills, so a lone long prompt still fills whole steps.

With speculative decoding on, a decoding request may also get draft tokens (`draft_token_ids`) from
the budget and free blocks left after everyone's real tokens: drafts never preempt, never delay an
admission, and never count as computed until `accept_drafts` says the model agreed with them.

What a step computes (`SchedulerOutput`, its `ScheduledRequest` rows) is `core/scheduler_output.py`'s.

Long module: one state, the running, waiting and paused queues, which the running pass, the admission pass,
the leftover pass, finishing and a handoff's pause and resume all read and write; split apart, each would
reach into the others' queues.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

from tokenloop.config import SchedulerConfig
from tokenloop.core.block_pool import KVBlock
from tokenloop.core.kv_cache import BlockRelease, KVCacheManager
from tokenloop.core.policy import Policy, make_policy
from tokenloop.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tokenloop.core.speculative import DraftProposer
from tokenloop.core.waiting_queue import RanksWaiting, WaitingQueue
from tokenloop.errors import CapacityError, InvalidRequestError
from tokenloop.request import Clock, Request, RequestStatus, default_clock

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of queue lengths and cache counters (prefix-cache numbers in tokens)."""

    num_running: int
    num_waiting: int
    num_preempted_waiting: int
    num_preemptions: int
    kv_usage: float
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    evictions: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class _StepPlan:
    """One `schedule()` call's working state: the output being built, the token budget left, the long
    prefills' rows (held to the threshold until everyone had a turn, then topped up) and their count."""

    __slots__ = ("budget", "kv", "kv_ns", "long_rows", "now", "num_long", "output", "policy", "scheduled_ids",
                 "threshold")

    def __init__(self, now: int, config: SchedulerConfig, policy: Policy, kv: KVCacheManager) -> None:
        self.now = now
        self.policy = policy
        self.kv = kv
        self.budget = config.max_num_batched_tokens
        self.threshold = config.long_prefill_threshold
        self.output = SchedulerOutput()
        self.scheduled_ids: set[str] = set()
        self.long_rows: list[ScheduledRequest] = []
        self.num_long = 0  # long prefills in progress: beyond max_long_partial_prefills, a waiting one yields
        self.kv_ns = 0

    def add(self, request: Request, n: int, new_block_ids: list[int], admitted: bool = False,
            num_reused: int = 0, hit_tokens: int = 0) -> None:
        """Schedule `n` tokens of `request` with this step's block-table diff."""
        start, num_tokens = request.num_computed_tokens, request.num_tokens
        self.policy.on_scheduled(request, n)
        row = ScheduledRequest(request, n, start, start + n == num_tokens, new_block_ids,
                               self.kv.num_blocks_held(request.request_id), admitted, num_reused, hit_tokens)
        self.output.scheduled.append(row)
        self.scheduled_ids.add(request.request_id)
        self.budget -= n
        if self.threshold and num_tokens - start > self.threshold:
            self.long_rows.append(row)


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching and preemption by recompute."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        clock: Clock = default_clock,
        policy: Policy | None = None,
        proposer: DraftProposer | None = None,
        max_loras: int = 0,
    ) -> None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {max_model_len}")
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.clock = clock
        self.policy: Policy = (policy if policy is not None
                               else make_policy(config.policy, config, max_model_len=max_model_len))
        self.proposer = proposer  # speculative decoding's drafts; None: off
        self.max_loras = max_loras  # distinct LoRA adapters among running requests at most (0: no adapters)
        # Dicts keyed by request id: O(1) removal, and iteration in insertion order.
        self._running: dict[str, Request] = {}
        self._waiting: dict[str, Request] = {}
        # The waiting requests kept in policy order (a policy with `waiting_key`), so a long queue is not
        # sorted every step; requests are ranked when the waiting pass next runs, so what fails to rank
        # fails there, as a whole-queue sort would.
        self._waiting_order = (WaitingQueue(cast(RanksWaiting, self.policy)) if hasattr(self.policy, "waiting_key")
                               else None)
        self._unranked: list[Request] = []
        # Exporting (handoff): out of both queues, blocks kept; with the status to go back to on a resume.
        self._paused: dict[str, tuple[Request, RequestStatus]] = {}
        # Imported running requests whose block table the runner has not seen: their next turn ships it all.
        self._fresh_tables: set[str] = set()
        self.num_preemptions = 0
        self._num_preempted_waiting = 0  # a counter, so stats() never scans the queue
        self._released_ids: list[str] = []  # for the next SchedulerOutput
        self._releases: list[tuple[Request, BlockRelease, int, int]] = []  # (request, release, start, end ns)

    # ---- queues ------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_preempted_waiting(self) -> int:
        return self._num_preempted_waiting

    def running_requests(self) -> list[Request]:
        return list(self._running.values())

    def waiting_requests(self) -> list[Request]:
        return list(self._waiting.values())

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting or self._paused)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id (exporting ones too), or None."""
        paused = self._paused.get(request_id)
        return self._running.get(request_id) or self._waiting.get(request_id) or (paused and paused[0])

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_preempted_waiting=self._num_preempted_waiting,
            num_preemptions=self.num_preemptions,
            kv_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            evictions=kv.evictions,
        )

    # ---- lifecycle ---------------------------------------------------------------------------------

    def max_kv_tokens(self, request: Request) -> int:
        """The most tokens whose K/V the request can ever need: all but its last possible token."""
        max_tokens = request.sampling_params.max_tokens
        final_len = request.num_prompt_tokens + (max_tokens if max_tokens is not None else self.max_model_len)
        # The last token is sampled but never fed back; the prompt is always computed in full.
        final_len = max(request.num_prompt_tokens + 1, min(final_len, self.max_model_len))
        return final_len - 1

    def add_request(self, request: Request) -> None:
        """Queue a new request; rejects one that can never run, and refuses when the queue is full."""
        if request.request_id in self._running or request.request_id in self._waiting:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", param="request_id")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise InvalidRequestError(f"request {request.request_id!r} is not new ({request.status.value})")
        if request.num_prompt_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {request.num_prompt_tokens} tokens, more than the maximum context length "
                f"({self.max_model_len})", param="prompt")
        if not self.config.enable_chunked_prefill and request.num_prompt_tokens > self.config.max_num_batched_tokens:
            raise InvalidRequestError(
                f"the prompt has {request.num_prompt_tokens} tokens, more than fit in one step "
                f"(max_num_batched_tokens={self.config.max_num_batched_tokens}) with chunked prefill off",
                param="prompt")
        kv = self.kv_cache
        chunk = self.config.max_num_batched_tokens
        blocks_needed = kv.blocks_to_hold(self.max_kv_tokens(request), chunk)
        if blocks_needed > kv.num_blocks:
            # Such a request would evict everyone and still not fit: it would preempt forever.
            prompt_fits = kv.blocks_to_hold(request.num_prompt_tokens, chunk) <= kv.num_blocks
            raise InvalidRequestError(
                f"the request may need {self.max_kv_tokens(request)} tokens of KV cache "
                f"({blocks_needed} blocks of {kv.block_size}) but the whole cache holds only "
                f"{kv.num_blocks * kv.block_size} tokens ({kv.num_blocks} blocks); "
                + ("lower max_tokens" if prompt_fits else "shorten the prompt"),
                param="max_tokens" if prompt_fits else "prompt")
        if self.config.max_waiting is not None and len(self._waiting) >= self.config.max_waiting:
            raise CapacityError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        self._wait(request)
        self.policy.on_arrival(request, self.clock())

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a waiting, running or preempted request: set `status`, free its blocks.

        Returns the request, or None if the id is unknown or already finished (idempotent).
        """
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request = self._running.pop(request_id, None) or self._unwait(request_id)
        if request is None and request_id in self._paused:
            request = self._paused.pop(request_id)[0]
        if request is None:
            return None
        self._fresh_tables.discard(request_id)
        if request.status is RequestStatus.PREEMPTED:
            self._num_preempted_waiting -= 1
        request.status = status
        if request.times.finished is None:
            request.times.finished = self.clock()
        start = self.clock()
        release = self.kv_cache.free(request)
        self._releases.append((request, release, start, self.clock()))
        self._released_ids.append(request_id)
        self.policy.on_finished(request)
        return request

    def take_releases(self) -> list[tuple[Request, BlockRelease, int, int]]:
        """Requests finished since the last call, each with what its release did and when (start, end ns)."""
        releases, self._releases = self._releases, []
        return releases

    # ---- handoff: pause for an export, resume, adopt an import ---------------------------------------

    def pause(self, request_id: str) -> Request:
        """Take an unfinished request out of both queues, keeping its blocks (status EXPORTING)."""
        request = self._running.pop(request_id, None) or self._unwait(request_id)
        if request is None:
            raise InvalidRequestError(f"request {request_id!r} is not running or waiting here",
                                      param="request_id")
        if request.status is RequestStatus.PREEMPTED:
            self._num_preempted_waiting -= 1
        self._paused[request_id] = (request, request.status)
        request.status = RequestStatus.EXPORTING
        return request

    def resume(self, request_id: str) -> Request | None:
        """Put a paused request back where it was; None if it is not paused."""
        entry = self._paused.pop(request_id, None)
        if entry is None:
            return None
        request, status = entry
        request.status = status
        if status is RequestStatus.RUNNING:
            self._running[request_id] = request
        else:
            self._wait(request)
            if status is RequestStatus.PREEMPTED:
                self._num_preempted_waiting += 1
        return request

    def adopt_running(self, request: Request) -> None:
        """Run an imported request whose blocks the KV cache already holds (`KVCacheManager.adopt`).

        Its next turn sends the runner its whole table, as an admission does."""
        if self.get_request(request.request_id) is not None:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use",
                                      param="request_id")
        request.status = RequestStatus.RUNNING
        self._running[request.request_id] = request
        self._fresh_tables.add(request.request_id)
        self.policy.on_arrival(request, self.clock())

    # ---- one step ----------------------------------------------------------------------------------

    @staticmethod
    def _chunk(num_left: int, budget: int, threshold: int) -> int:
        # min() without the builtin calls: this runs for every row of every step.
        n = num_left if num_left < budget else budget  # not min(): the builtin call costs more
        return threshold if 0 < threshold < n else n

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop its blocks; it waits again and recomputes from scratch."""
        del self._running[request.request_id]
        self._fresh_tables.discard(request.request_id)
        self.kv_cache.free(request)
        self._released_ids.append(request.request_id)
        self._num_preempted_waiting += 1
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._wait(request)

    def _wait(self, request: Request) -> None:
        self._waiting[request.request_id] = request
        if self._waiting_order is not None:
            self._unranked.append(request)

    def _unwait(self, request_id: str) -> Request | None:
        if self._waiting_order is not None:
            self._waiting_order.remove(request_id)
        return self._waiting.pop(request_id, None)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running requests first, then admissions, all in policy order; then the
        budget nobody took goes to long prefills and drafts."""
        step = _StepPlan(self.clock(), self.config, self.policy, self.kv_cache)
        self._schedule_running(step)
        # Admitting right after preempting would only evict again what was just made room for.
        held_for_blocks = False if step.output.preempted else self._admit_waiting(step)
        self._spend_leftover(step, held_for_blocks)
        output = step.output
        output.num_batched_tokens = self.config.max_num_batched_tokens - step.budget
        output.kv_ns = step.kv_ns
        if self.kv_cache.num_groups > 1:
            self._group_diffs(output.scheduled)
        output.released_request_ids, self._released_ids = self._released_ids, []
        return output

    def _schedule_running(self, step: _StepPlan) -> None:
        """The running pass: each running request's next chunk or decode token, preempting (policy's victim)
        when blocks run out. Each request's turn is isolated: what raises for one fails that one alone."""
        kv, output, threshold, timer = self.kv_cache, step.output, step.threshold, time.perf_counter_ns
        for request in self._in_policy_order(self._running, step.now, output, running=True):
            if step.budget <= 0:
                break
            if request.request_id not in self._running:
                continue  # preempted earlier in this step
            try:
                num_left = request.num_tokens - request.num_computed_tokens
                if threshold and num_left > threshold:
                    step.num_long += 1
                n = self._chunk(num_left, step.budget, threshold)
                if n <= 0:
                    continue  # nothing known left to compute (the caller has not appended a token yet)
                # A decode token that fits the blocks held costs a check, not a timed allocation (two clock
                # reads cost more than the check: this runs for nearly every row of every step).
                new_blocks: list[KVBlock] | None = [] if kv.fits_held(request, n) else None
                while new_blocks is None:
                    begin = timer()
                    new_blocks = kv.allocate(request, n)
                    step.kv_ns += timer() - begin
                    if new_blocks is not None:
                        break
                    candidates = [r for r in self._running.values() if r.request_id not in step.scheduled_ids]
                    victim = self._victim(candidates, step.now)
                    self._preempt(victim)
                    output.preempted.append(victim)
                    if victim is request:
                        break
                if request.request_id in self._fresh_tables:  # imported: the runner gets its whole table
                    self._fresh_tables.discard(request.request_id)
                    table = kv.get_block_ids(request.request_id)
                    step.add(request, n, table, True, len(table) - len(new_blocks or ()))
                elif request.request_id in self._running:
                    step.add(request, n, [b.block_id for b in new_blocks] if new_blocks else [])
            except Exception:  # noqa: BLE001 - logged and turned into this request's error
                self._fail_request(request, "scheduling", output)

    def _admit_waiting(self, step: _StepPlan) -> bool:
        """The admission pass: waiting requests in policy order while budget, sequences and blocks last.
        Returns whether one was held for want of blocks (waiting requests never preempt, and later ones do
        not overtake it)."""
        kv, output, timer = self.kv_cache, step.output, time.perf_counter_ns
        threshold, max_long = step.threshold, self.config.max_long_partial_prefills
        for request in self._waiting_in_order(step.now, output):
            if step.budget <= 0 or len(self._running) >= self.config.max_num_seqs:
                break
            if request.request_id not in self._waiting:
                continue
            if request.lora_name is not None and not self.adapter_fits(request.lora_name):
                continue  # its adapter would be one more than the slots hold: it waits for one to free
            try:
                begin = timer()
                computed_blocks, num_hit = kv.get_computed_blocks(request)
                step.kv_ns += timer() - begin
            except Exception:  # noqa: BLE001 - e.g. a cache salt that cannot be hashed
                self._fail_request(request, "looking up the prefix cache for", output)
                continue
            num_left = request.num_tokens - num_hit
            is_long = 0 < threshold < num_left
            if is_long and 0 < max_long <= step.num_long:
                continue  # enough long prefills run: shorter requests behind this one go first
            if self.config.enable_chunked_prefill:
                n = self._chunk(num_left, step.budget, threshold)
            elif num_left <= step.budget:
                n = num_left
            elif num_left > self.config.max_num_batched_tokens:
                # Only a preempted request grows past one step's budget; it must recompute in chunks.
                n = step.budget
            else:
                break  # it waits for a step with room for all of it
            try:
                begin = timer()
                new_blocks = kv.allocate(request, n, computed_blocks, num_hit)
                step.kv_ns += timer() - begin
                if new_blocks is None:
                    return True
                self._start_running(request, num_hit, step.now)
                step.add(request, n, [b.block_id for b in computed_blocks] + [b.block_id for b in new_blocks],
                         True, len(computed_blocks), num_hit)
                step.num_long += is_long
            except Exception:  # noqa: BLE001 - logged and turned into this request's error
                self._fail_request(request, "admitting", output)
        return False

    def _start_running(self, request: Request, num_hit: int, now: int) -> None:
        """Move an admitted request from the waiting queue to the running set, `num_hit` tokens cached."""
        self._unwait(request.request_id)
        self._running[request.request_id] = request
        if request.status is RequestStatus.PREEMPTED:
            self._num_preempted_waiting -= 1
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        if request.times.first_scheduled is None:
            request.times.first_scheduled = now
            request.num_cached_tokens = num_hit

    def _spend_leftover(self, step: _StepPlan, held_for_blocks: bool) -> None:
        """Work-conserving: the budget nobody else took goes back to the long prefills (a lone long prompt
        still fills whole steps), then to speculative drafts. Neither in a step that preempted or held a
        request for want of blocks: the free blocks are theirs."""
        output = step.output
        if step.long_rows and step.budget > 0 and not output.preempted and not held_for_blocks:
            used, top_up_kv_ns = self._top_up(step.long_rows, step.budget, output)
            step.budget -= used
            step.kv_ns += top_up_kv_ns
        if (self.proposer is not None and step.budget > 0 and not output.preempted
                and self.proposer.drafts_allowed(len(self._running))
                and (not self._waiting or len(self._running) >= self.config.max_num_seqs)):
            output.num_draft_tokens, draft_kv_ns = self._add_drafts(output.scheduled, step.budget)
            step.budget -= output.num_draft_tokens
            step.kv_ns += draft_kv_ns

    def adapter_fits(self, lora_name: str) -> bool:
        """Whether running one more request of `lora_name` keeps the running adapters within max_loras."""
        running = {r.lora_name for r in self._running.values() if r.lora_name is not None}
        return lora_name in running or len(running) < self.max_loras

    def _group_diffs(self, scheduled: list[ScheduledRequest]) -> None:
        """Every group's block-table diff of each row: the positions group 0's `new_block_ids` cover."""
        kv = self.kv_cache
        for item in scheduled:
            request_id = item.request_id
            start = kv.num_blocks_held(request_id) - len(item.new_block_ids)
            item.group_block_ids = [kv.get_block_ids(request_id, group)[start:]
                                    for group in range(kv.num_groups)]

    def _top_up(self, rows: list[ScheduledRequest], budget: int, output: SchedulerOutput) -> tuple[int, int]:
        """Extend long prefills' rows (in the order they were scheduled) by up to `budget` tokens in all,
        as far as free blocks allow; never preempts. Returns (tokens added, KV ns)."""
        kv = self.kv_cache
        timer = time.perf_counter_ns
        used = kv_ns = 0
        for item in rows:
            request = item.request
            start, n = item.num_computed_tokens, item.num_tokens
            extra = min(budget - used, request.num_tokens - start - n)
            if extra <= 0 or request.request_id not in self._running:
                continue  # done with its tokens, or failed since it was scheduled
            try:
                begin = timer()
                new_blocks = kv.allocate(request, n + extra)
                kv_ns += timer() - begin
                if new_blocks is None:
                    continue  # the pool is short: it keeps its first share
                self.policy.on_scheduled(request, extra, start + n)
            except Exception:  # noqa: BLE001 - logged and turned into this request's error
                self._fail_request(request, "scheduling", output)
                used -= n  # its row is gone with its first share
                continue
            item.num_tokens = n + extra
            item.chunk.samples = start + n + extra == request.num_tokens
            item.new_block_ids.extend(block.block_id for block in new_blocks)
            item.num_blocks = kv.num_blocks_held(request.request_id)
            used += extra
        return used, kv_ns

    def _add_drafts(self, scheduled: list[ScheduledRequest], budget: int) -> tuple[int, int]:
        """Give decoding rows their proposals, within `budget` and the free blocks; (drafts added, KV ns)."""
        assert self.proposer is not None
        kv = self.kv_cache
        timer = time.perf_counter_ns
        used = kv_ns = 0
        for item in scheduled:
            if used >= budget:
                break
            request = item.request
            if item.num_tokens != 1 or not item.samples or item.admitted:
                continue
            # No draft past the request's last possible K/V slot (max_tokens, max_model_len), nor in a block
            # that would evict a cached prefix.
            room = min(budget - used, self.max_kv_tokens(request) - request.num_tokens,
                       kv.num_slots_without_eviction(request.request_id) - request.num_tokens)
            try:
                drafts = self.proposer.propose(request, room)
                if not drafts:
                    continue
                begin = timer()
                new_blocks = kv.allocate(request, 1 + len(drafts))  # the real token's blocks are held already
                kv_ns += timer() - begin
            except Exception:
                logger.exception("proposing drafts for request %s failed", request.request_id)
                continue
            if new_blocks is None:
                continue  # cannot happen (room counts free blocks); drafts never preempt anyone
            item.draft_token_ids = drafts
            item.num_tokens += len(drafts)
            item.new_block_ids.extend(block.block_id for block in new_blocks)
            item.num_blocks = kv.num_blocks_held(request.request_id)
            used += len(drafts)
        return used, kv_ns

    def accept_drafts(self, item: ScheduledRequest, num_accepted: int) -> None:
        """After verification, with the accepted drafts appended to the request: their K/V count as computed
        and full blocks of them are published. Rejected drafts' slots are simply overwritten later; blocks
        taken only for them stay in the table for the tokens to come."""
        request = item.request
        if (request.request_id in self._running
                and request.num_computed_tokens == item.num_computed_tokens + 1 and num_accepted > 0):
            request.num_computed_tokens += num_accepted
            self.kv_cache.publish_computed(request)

    # ---- fault isolation -----------------------------------------------------------------------------

    def _in_policy_order(self, queue: dict[str, Request], now: int, output: SchedulerOutput,
                         running: bool = False) -> Iterator[Request]:
        """The policy's order over `queue`; a request whose ranking raises is failed, the others go on."""
        seen: set[str] = set()
        rank = self.policy.order_running if running else self.policy.order
        while True:
            pending = [r for r in queue.values() if r.request_id not in seen] if seen else list(queue.values())
            try:
                for request in rank(pending, now):
                    seen.add(request.request_id)
                    yield request
                return
            except Exception:
                culprits = [r for r in pending if r.request_id not in seen and not self._ranks(r, now)]
                if not culprits:
                    raise  # the policy fails on its own: not one request's fault
                for request in culprits:
                    self._fail_request(request, "ranking", output)

    def _waiting_in_order(self, now: int, output: SchedulerOutput) -> Iterator[Request]:
        """The waiting queue in policy order: kept incrementally when the policy can, else sorted now."""
        queue = self._waiting_order
        if queue is None:
            return self._in_policy_order(self._waiting, now, output)
        unranked, self._unranked = self._unranked, []
        for request in unranked:
            if self._waiting.get(request.request_id) is request and request.request_id not in queue:
                try:
                    queue.add(request)
                except Exception:  # noqa: BLE001 - this request's ranking fails: it alone fails
                    self._fail_request(request, "ranking", output)
        return queue.ordered(now)

    def _ranks(self, request: Request, now: int) -> bool:
        try:
            list(self.policy.order([request], now))
        except Exception:  # noqa: BLE001 - the probe's whole point
            return False
        return True

    def _victim(self, candidates: list[Request], now: int) -> Request:
        try:
            return self.policy.victim(candidates, now)
        except Exception:
            logger.exception("the %s policy failed to pick a victim; preempting the latest arrival", self.policy.name)
            return max(candidates, key=lambda r: r.times.arrival)

    def _fail_request(self, request: Request, stage: str, output: SchedulerOutput) -> None:
        """End `request` with an error that names only its own stage, and release its blocks."""
        logger.exception("the scheduler failed while %s request %s", stage, request.request_id)
        request.error = f"the server failed while {stage} this request"
        output.scheduled = [item for item in output.scheduled if item.request is not request]
        try:
            self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
        except Exception:
            logger.exception("finishing failed request %s raised", request.request_id)
            self._running.pop(request.request_id, None)
            self._unwait(request.request_id)
            request.status = RequestStatus.FINISHED_ERROR
            self._released_ids.append(request.request_id)
            self._releases.append((request, self.kv_cache.free(request), self.clock(), self.clock()))
        output.failed.append(request)

    def update_from_output(self, output: SchedulerOutput) -> None:
        """Advance each scheduled request by the tokens the step computed (the caller appends samples)."""
        for item in output.scheduled:
            request, chunk = item.request, item.chunk  # the row's plain values, without its properties
            if request.request_id in self._running and request.num_computed_tokens == chunk.start:
                # Drafts count once verified (accept_drafts).
                request.num_computed_tokens += chunk.num_tokens - len(item.draft_token_ids)
