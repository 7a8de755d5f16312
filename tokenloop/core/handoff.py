"""Request handoff: one engine core exports a request (state + missing KV blocks), another imports it.

The protocol is a lease with acknowledgement. `export` pauses the request on the source (EXPORTING: the
scheduler skips it, its blocks stay referenced) and returns a `KVSnapshot` carrying a lease. The
destination's `import_` takes it or refuses with a reason (never raises for a refusal). The source then
gets the ack (`complete`: its references are released, not evicted: the blocks keep their hashes) or the
nack (`resume`); a lease nobody answered resumes the request by itself once it expires, on the source's
clock, checked once per step. Correctness never depends on the copy: a block the destination neither holds
nor received is recomputed there from the longest usable prefix.

Full blocks never change once written (their hash names their tokens), so live migration can pre-copy
them while the request keeps decoding (`precopy` / `store`) and the final export skips them by hash.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenloop.core.block_pool import KVBlock
from tokenloop.core.kv_cache import KVCacheManager
from tokenloop.core.scheduler import Scheduler
from tokenloop.errors import CapacityError, InvalidRequestError
from tokenloop.request import NS_PER_S, Clock, Request, RequestStatus, SamplingParams

if TYPE_CHECKING:
    from tokenloop.runner import ModelRunner
    from tokenloop.sampler import Sampler
    from tokenloop.structured.engine_hooks import StructuredOutputs


@dataclass(slots=True)
class KVBlockData:
    """One full block's (or the partial tail block's) K/V for every layer, as bytes."""

    block_hash: int | None  # None for the partial tail block
    num_tokens: int
    data: bytes  # K then V of each layer for the first num_tokens slots, in the engine's KV dtype, C order
    parent_hash: int | None = None  # the block before it in its chain: the destination's KV events name it
    token_ids: list[int] = field(default_factory=list)  # its tokens, for the same events
    group: int = 0  # the KV group whose layers `data` holds (docs/kv-groups.md)


@dataclass(slots=True)
class RequestState:
    """Everything to continue a request elsewhere; times are ages at export, so they rebase."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    priority: int
    user: str | None
    cache_salt: str | None
    prompt: str | None
    generator_state: bytes | None  # a seeded request's torch.Generator state
    age_ns: int  # now - arrival, at export
    first_scheduled_age_ns: int | None
    first_token_age_ns: int | None
    token_ages_ns: list[int]  # each output token's age: inter-token latencies survive the move
    num_cached_tokens: int
    num_preemptions: int
    fair_charge: float  # what its service cost its user's account at the source (fair-share policy)
    num_prompt_logprobs_sent: int = 0  # prompt logprobs already reported to its user
    lora_name: str | None = None  # its LoRA adapter: the destination must serve it too


@dataclass(slots=True)
class KVSnapshot:
    """A request in transit, and the lease under which the source keeps its blocks."""

    lease_id: str
    request: RequestState
    model: str
    block_size: int
    kv_layout: str  # the destination refuses a mismatch of any of these three, naming both (groups included)
    num_computed_tokens: int
    block_hashes: list[int]  # every full block of the computed tokens, in order (one chain for every group)
    # Per KV group, in group order: its full blocks not skipped by hash (a sliding group's only from its
    # window on), then its partial tail (if any).
    blocks: list[KVBlockData]
    lease_expires_ns: int  # source clock: after it the source resumes the request


@dataclass(slots=True)
class ImportResult:
    """What the destination did with a snapshot."""

    request_id: str
    accepted: bool
    reason: str | None  # why it refused
    num_blocks_matched: int = 0  # found by hash in its own prefix cache
    num_blocks_copied: int = 0  # written from the snapshot (the tail counted)
    num_tokens_recomputed: int = 0  # computed at the source, recomputed here
    bytes_copied: int = 0


@dataclass(slots=True)
class _Lease:
    request_id: str
    expires_ns: int


class HandoffStage:
    """The engine core's handoff stage over its scheduler, KV cache and runner; holds the open leases."""

    def __init__(self, model: str, scheduler: Scheduler, kv_cache: KVCacheManager, runner: ModelRunner,
                 sampler: Sampler, structured: StructuredOutputs, vocab_size: int, eos_token_ids: frozenset[int],
                 max_num_seqs: int, clock: Clock) -> None:
        self.model = model
        self.scheduler = scheduler
        self.kv = kv_cache
        self.runner = runner
        self.sampler = sampler
        self.structured = structured
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.clock = clock
        self._leases: dict[str, _Lease] = {}
        self._num_leases = 0

    # ---- the source side -----------------------------------------------------------------------------

    def export(self, request: Request, skip_hashes: list[int], lease_s: float,
               num_prompt_logprobs_sent: int = 0) -> KVSnapshot:
        """Pause `request` (unfinished, not exporting) and describe it, with the blocks not in skip_hashes."""
        if not 0 < lease_s < math.inf:
            raise InvalidRequestError(f"lease_s must be a positive number of seconds, got {lease_s}",
                                      param="lease_s")
        if request.status is RequestStatus.EXPORTING:
            raise InvalidRequestError(f"request {request.request_id!r} is already being exported",
                                      param="request_id")
        now = self.clock()
        charge = self.scheduler.policy.charge(request)
        computed = request.num_computed_tokens
        num_full = computed // self.kv.block_size
        hashes = list(self.kv.block_hashes(request)[:num_full])
        blocks = self._block_data(request, computed, set(skip_hashes), with_tail=True)
        self.scheduler.pause(request.request_id)  # after reading: a read that raises leaves it running
        self._num_leases += 1
        lease_id = f"{request.request_id}#{self._num_leases}"
        expires = now + int(lease_s * NS_PER_S)
        self._leases[lease_id] = _Lease(request.request_id, expires)
        return KVSnapshot(lease_id, _state_of(request, now, charge, num_prompt_logprobs_sent), self.model,
                          self.kv.block_size, self.runner.kv_layout, computed, hashes, blocks, expires)

    def complete(self, lease_id: str) -> Request | None:
        """The ack: the request leaves (HANDED_OFF, references released); None if there is no such lease."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return None
        return self.scheduler.finish_request(lease.request_id, RequestStatus.HANDED_OFF)

    def resume(self, lease_id: str) -> bool:
        """The nack: the request runs here again. False if there is no such lease (answered or expired)."""
        lease = self._leases.pop(lease_id, None)
        return lease is not None and self.scheduler.resume(lease.request_id) is not None

    def expire(self) -> list[str]:
        """Resume every request whose lease ran out; their ids. Once per step."""
        if not self._leases:
            return []
        now = self.clock()
        expired = [lease_id for lease_id, lease in self._leases.items() if lease.expires_ns <= now]
        ids = [self._leases[lease_id].request_id for lease_id in expired]
        for lease_id in expired:
            self.resume(lease_id)
        return ids

    def drop(self, request_id: str) -> None:
        """Forget the lease of a request that ended here (aborted while exporting)."""
        for lease_id in [k for k, lease in self._leases.items() if lease.request_id == request_id]:
            del self._leases[lease_id]

    def precopy(self, request: Request, skip_hashes: list[int], max_blocks: int | None = None) -> list[KVBlockData]:
        """The request's computed full blocks not in skip_hashes (at most `max_blocks`), read without pausing
        it."""
        if max_blocks is not None and max_blocks < 1:
            raise InvalidRequestError(f"max_blocks must be >= 1, got {max_blocks}", param="max_blocks")
        return self._block_data(request, request.num_computed_tokens, set(skip_hashes), with_tail=False,
                                max_blocks=max_blocks)

    def _block_data(self, request: Request, num_tokens: int, skip: set[int],
                    with_tail: bool, max_blocks: int | None = None) -> list[KVBlockData]:
        size = self.kv.block_size
        hashes = self.kv.block_hashes(request)
        tokens = request.all_token_ids
        num_full = num_tokens // size
        tail = num_tokens - num_full * size
        read = self.runner.read_block
        wanted = [i for i in range(num_full) if hashes[i] not in skip][:max_blocks]
        blocks: list[KVBlockData] = []
        for group in range(self.kv.num_groups):
            table = self.kv.get_blocks(request.request_id, group)
            if len(table) < self.kv.num_blocks_for(num_tokens):
                raise RuntimeError(f"{request.request_id}: {len(table)} blocks cannot hold {num_tokens} tokens")
            first = self._first_needed(group, num_tokens)  # a sliding group's blocks before it are released
            blocks += [KVBlockData(hashes[i], size, read(table[i].block_id, size), hashes[i - 1] if i else None,
                                   tokens[i * size:(i + 1) * size], group)
                       for i in wanted if i >= first]
            if with_tail and tail:
                blocks.append(KVBlockData(None, tail, read(table[num_full].block_id, tail),
                                          hashes[num_full - 1] if num_full else None,
                                          tokens[num_full * size:num_tokens], group))
        return blocks

    def _first_needed(self, group: int, num_computed_tokens: int) -> int:
        """The first block position `group` holds once `num_computed_tokens` are computed."""
        spec = self.kv.groups[group]
        return self.kv.first_live_block(num_computed_tokens, spec.window) if spec.kind == "sliding" else 0

    # ---- the destination side ------------------------------------------------------------------------

    def import_(self, snapshot: KVSnapshot, id_in_use: bool) -> tuple[ImportResult, Request | None]:
        """Take the request (RUNNING with its K/V, or WAITING to recompute what it lacks) or refuse."""
        state = snapshot.request
        reason = self._refusal(snapshot, id_in_use)
        request = None
        if reason is None:
            try:
                request = self._rebuild(state)
            except (InvalidRequestError, ValueError) as exc:
                reason = f"the request cannot continue here: {exc}"
        if request is not None and reason is None:
            needed = self.kv.blocks_to_hold(self.scheduler.max_kv_tokens(request),
                                            self.scheduler.config.max_num_batched_tokens)
            max_tokens = request.sampling_params.max_tokens
            final_len = (request.num_prompt_tokens + max_tokens if max_tokens is not None
                         else request.num_tokens)
            if final_len > self.scheduler.max_model_len:  # it would stop short here: not the same request
                reason = (f"no room: the request may grow to {final_len} tokens and this engine's context "
                          f"holds {self.scheduler.max_model_len}")
            elif needed > self.kv.num_blocks:
                reason = (f"no room: the request may need {needed} blocks of {self.kv.block_size} and this "
                          f"engine's whole pool holds {self.kv.num_blocks}")
        if reason is not None or request is None:
            return ImportResult(state.request_id, False, reason), None
        copies = {(b.group, b.block_hash): b for b in snapshot.blocks if b.block_hash is not None}
        tails = {b.group: b for b in snapshot.blocks if b.block_hash is None}
        computed = snapshot.num_computed_tokens
        # Per group and full block: matched here, None (copied from the snapshot) or, before a sliding
        # window, the released entry; every group's plan is cut to the prefix all of them can serve.
        plans: list[list[KVBlock | None]] = []
        for group in range(self.kv.num_groups):
            first = self._first_needed(group, computed)
            plan: list[KVBlock | None] = [self.kv.released_block] * min(first, len(snapshot.block_hashes))
            for block_hash in snapshot.block_hashes[len(plan):]:
                block = self.kv.pool.lookup(block_hash, group) if self.kv.enable_caching else None
                if block is None and (group, block_hash) not in copies:
                    break  # evicted meanwhile, or skipped in error: recompute from here on
                plan.append(block)
            plans.append(plan)
        usable = min(len(plan) for plan in plans)
        plans = [plan[:usable] for plan in plans]
        whole = usable == len(snapshot.block_hashes) and (
            len(tails) == self.kv.num_groups or computed % self.kv.block_size == 0)
        # Running it beside max_loras other adapters would overfill the adapter slots in the next step: it
        # waits (its K/V kept in the prefix cache) until the scheduler admits it as it admits local requests.
        adapter_fits = request.lora_name is None or self.scheduler.adapter_fits(request.lora_name)
        if computed and whole and self.scheduler.num_running < self.max_num_seqs and adapter_fits:
            result = self._adopt(snapshot, request, plans, copies, tails)
        else:
            result = self._queue(snapshot, request, plans, copies)
        if result.accepted:
            self.scheduler.policy.on_imported(request, state.fair_charge)
            return result, request
        return result, None

    def store(self, blocks: list[KVBlockData], lora_name: str | None = None) -> int:
        """Put full blocks from elsewhere into the prefix cache, unreferenced (a pre-copy); how many.
        `lora_name`: the adapter whose K/V they are, for the KV events (None where unknown or the base's)."""
        stored = 0
        for group in range(self.kv.num_groups):
            full = [b for b in blocks if b.block_hash is not None and b.group == group and self._fits(b)]
            entries = [(b.block_hash, b.parent_hash, b.token_ids) for b in full if b.block_hash is not None]

            def write(block_id: int, i: int, full: list[KVBlockData] = full) -> None:
                self.runner.write_block(block_id, full[i].data, full[i].num_tokens)

            stored += self.kv.store_cached(entries, write, group, lora_name)
        return stored

    def _fits(self, block: KVBlockData) -> bool:
        return len(block.data) == block.num_tokens * self.runner.kv_bytes_per_token

    def _refusal(self, snapshot: KVSnapshot, id_in_use: bool) -> str | None:
        state = snapshot.request
        mine = (self.model, self.kv.block_size, self.runner.kv_layout)
        theirs = (snapshot.model, snapshot.block_size, snapshot.kv_layout)
        for name, here, there in zip(("model", "block size", "KV layout"), mine, theirs):
            if here != there:
                return f"other {name}: the snapshot's is {there!r}, this engine's {here!r}"
        if id_in_use:
            return f"duplicate id: request {state.request_id!r} is already in this engine"
        served = getattr(self.runner, "adapters", None)
        if state.lora_name is not None and (served is None or state.lora_name not in served.registered):
            return f"this engine does not serve the LoRA adapter {state.lora_name!r}"
        vocab = self.vocab_size
        bad = [t for t in (*state.prompt_token_ids, *state.output_token_ids) if not 0 <= t < vocab]
        if bad:
            return f"token id {bad[0]} is outside this engine's vocabulary [0, {vocab})"
        if not state.prompt_token_ids:
            return "the prompt is empty"
        if snapshot.num_computed_tokens >= len(state.prompt_token_ids) + len(state.output_token_ids):
            return "the snapshot claims more computed tokens than the request has"
        wrong = [b for b in snapshot.blocks if not self._fits(b)]
        if wrong:
            block = wrong[0]
            return (f"a block carries {len(block.data)} bytes for {block.num_tokens} tokens; this engine "
                    f"keeps {self.runner.kv_bytes_per_token} per token")
        return None

    def _rebuild(self, state: RequestState) -> Request:
        """The request as this engine's own: times rebased to its clock, generator and grammar restored."""
        if state.params.n != 1:
            raise InvalidRequestError("the engine core takes one sample per request (n=1)")
        self.sampler.validate(state.params)
        now = self.clock()
        request = Request(state.request_id, state.prompt_token_ids, state.params, now - state.age_ns,
                          prompt=state.prompt, priority=state.priority, user=state.user,
                          cache_salt=state.cache_salt, eos_token_ids=self.eos_token_ids,
                          lora_name=state.lora_name)
        for token in state.output_token_ids:
            request.append_output_token(token)
        times = request.times
        scheduled_age, token_age = state.first_scheduled_age_ns, state.first_token_age_ns
        times.first_scheduled = None if scheduled_age is None else now - scheduled_age
        times.first_token = None if token_age is None else now - token_age
        times.token_times = [now - age for age in state.token_ages_ns]
        request.num_cached_tokens = state.num_cached_tokens
        request.num_preemptions = state.num_preemptions
        if state.generator_state is not None:
            import torch  # here: the snapshot's types travel through the front end, which has no torch

            request.generator = torch.Generator()
            request.generator.set_state(torch.frombuffer(bytearray(state.generator_state), dtype=torch.uint8))
        grammar = self.structured.compile(state.params.structured_outputs)
        if grammar is not None:  # replaying the output rebuilds the matcher's state exactly
            matcher = grammar.new_matcher()
            for token in state.output_token_ids:
                if not matcher.accept(token):
                    raise ValueError(f"output token {token} does not fit its grammar here: {matcher.error}")
            request.structured = matcher
        return request

    def _adopt(self, snapshot: KVSnapshot, request: Request, plans: list[list[KVBlock | None]],
               copies: dict[tuple[int, int], KVBlockData], tails: dict[int, KVBlockData]) -> ImportResult:
        """RUNNING with every computed token's K/V: matched blocks touched, the rest written to fresh ones."""
        request.num_computed_tokens = snapshot.num_computed_tokens
        written = [[copies[group, h] for h, block in zip(snapshot.block_hashes, plan) if block is None]
                   for group, plan in enumerate(plans)]
        if tails:
            plans = [[*plan, None] for plan in plans]
            written = [[*group_written, tails[group]] for group, group_written in enumerate(written)]
        num_written = sum(len(group_written) for group_written in written)
        fresh = self.kv.adopt(request, plans)
        if fresh is None:
            return ImportResult(request.request_id, False,
                                f"no room: {num_written} free blocks needed, {self.kv.num_free_blocks} free")
        for group_fresh, group_written in zip(fresh, written):
            for block, data in zip(group_fresh, group_written):
                self.runner.write_block(block.block_id, data.data, data.num_tokens)
        self.scheduler.adopt_running(request)
        num_matched = sum(1 for plan in plans for block in plan if block is not None and block.block_id >= 0)
        return ImportResult(request.request_id, True, None, num_matched, num_written, 0,
                            sum(len(d.data) for group_written in written for d in group_written))

    def _queue(self, snapshot: KVSnapshot, request: Request, plans: list[list[KVBlock | None]],
               copies: dict[tuple[int, int], KVBlockData]) -> ImportResult:
        """WAITING: what arrived goes to the prefix cache; admission finds it by hash, recomputes the rest."""
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        try:
            self.scheduler.add_request(request)
        except (InvalidRequestError, CapacityError) as exc:
            return ImportResult(request.request_id, False, f"refused by the scheduler: {exc}")
        usable = [copies[group, h] for group, plan in enumerate(plans)
                  for h, block in zip(snapshot.block_hashes, plan) if block is None]
        stored = self.store(usable, request.lora_name)
        usable_tokens = len(plans[0]) * self.kv.block_size
        num_matched = sum(1 for plan in plans for block in plan if block is not None and block.block_id >= 0)
        return ImportResult(request.request_id, True, None, num_matched, stored,
                            max(0, snapshot.num_computed_tokens - usable_tokens),
                            sum(len(d.data) for d in usable))


def _state_of(request: Request, now: int, charge: float, num_prompt_logprobs_sent: int) -> RequestState:
    times = request.times
    generator = request.generator
    return RequestState(
        request.request_id, list(request.prompt_token_ids), list(request.output_token_ids),
        request.sampling_params, request.priority, request.user, request.cache_salt, request.prompt,
        generator.get_state().numpy().tobytes() if generator is not None else None,
        now - times.arrival, None if times.first_scheduled is None else now - times.first_scheduled,
        None if times.first_token is None else now - times.first_token, [now - t for t in times.token_times],
        request.num_cached_tokens, request.num_preemptions, charge, num_prompt_logprobs_sent,
        request.lora_name)
