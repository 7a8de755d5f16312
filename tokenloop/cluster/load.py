"""What a router knows of each replica: queue gauges, measured step costs, and its prefix index.

The step costs themselves, and their online fit, are `step_costs.py`.

One `LoadTracker` per cluster is fed by whoever owns the replicas (the replica set, or the simulator's
cluster): `on_routed` as a request is sent (the optimistic increment, as vLLM's data-parallel balancer
counts a request before the engine's next stats), `on_frame` with each replica's `CoreOutputs` (the
step record's gauges, the step's duration for the cost fit, its KV-event batch, the requests that
ended), and the replica's liveness and admission. Routers read `views()`, one `ReplicaLoad` per replica.

The prefix index is the replica's `KVIndexMirror`, rebuilt from its KV events. A gap in the batches
marks it stale until it is resynced from the engine's `kv_snapshot` (`resync`); a replica whose frames
keep coming without events for longer than `max_staleness_s` (events off, or the event path lost) is not
trusted either. Then `ReplicaLoad.cached_blocks` falls back to what this router itself sent there
recently, bounded by the replica's cache size: an estimate, never the stale set.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tokenloop.cluster.step_costs import DEFAULT_STEP_COSTS, StepCostFit, StepCosts
from tokenloop.core.kv_events import KVEventBatch, KVIndexMirror, KVIndexSnapshot
from tokenloop.core.messages import CoreOutputs
from tokenloop.observe.records import StepRecord

DEFAULT_MAX_STALENESS_S = 2.0
DEFAULT_RECENT_BLOCKS = 4096  # the fallback's bound before a replica has reported its cache size


@dataclass(slots=True)
class ReplicaLoad:
    """One replica as a router sees it (a snapshot of counters; the mappings are live views)."""

    index: int
    alive: bool
    admitting: bool
    num_running: int
    num_waiting: int  # the last gauges plus requests routed since them (optimistic)
    queued_prefill_tokens: int  # prompt tokens routed there and not yet computed (predicted hits excluded)
    costs: StepCosts
    mirror: KVIndexMirror
    staleness_s: float  # how long frames came without KV events (inf: a gap, not yet resynced)
    mirror_trusted: bool
    num_blocks: int | None = None
    # Admission: a request waits while its blocks or a sequence slot are not free; they free as requests
    # finish. None where the replica has not reported yet (no capacity limit is assumed then).
    num_free_blocks: int | None = None  # unreferenced blocks at the last stats (cached ones included)
    unadmitted: int = 0  # requests routed there whose prefill has not started
    unadmitted_blocks: int = 0  # the blocks those need
    finish_rate_per_s: float | None = None  # requests finished per second lately
    blocks_per_finish: float | None = None  # blocks a finishing request frees, on average
    mean_output_tokens: float | None = None  # tokens a finished request produced there, on average
    inflight: Mapping[int, int] = field(default_factory=dict)  # block hashes of requests still prefilling
    recent: Mapping[int, None] = field(default_factory=dict)  # block hashes routed there lately (bounded)
    # The LoRA adapters in its slots: those of the requests routed there that its steps ran lately, least
    # recently run first, at most its max_loras (its slots are swapped least recently used first too).
    resident_adapters: Mapping[str, None] = field(default_factory=dict)

    @property
    def candidate(self) -> bool:
        return self.alive and self.admitting

    def cached_blocks(self, block_hashes: Sequence[int]) -> int:
        """Leading blocks of a chain the replica will hold by the time the request runs.

        The mirror when trusted, else the bounded recent-routing estimate; either way a prefix a request
        in flight there is computing now counts, since the engine will have published it first.
        """
        known = self.mirror.longest_prefix(block_hashes) if self.mirror_trusted else \
            _longest(self.recent, block_hashes)
        return max(known, _longest(self.inflight, block_hashes))


def _ewma(mean: float | None, value: float, weight: float = 0.1) -> float:
    return float(value) if mean is None else (1 - weight) * mean + weight * value


def _longest(hashes: Mapping[int, object], chain: Sequence[int]) -> int:
    count = 0
    for block_hash in chain:
        if block_hash not in hashes:
            break
        count += 1
    return count


@dataclass(slots=True)
class _Flight:
    num_prompt_tokens: int
    remaining_prefill: int
    block_hashes: tuple[int, ...]
    blocks_needed: int  # new blocks its admission takes (its uncached prompt)
    admitted: bool = False
    num_output_tokens: int = 0
    lora_name: str | None = None


class _Replica:
    def __init__(self, index: int, seed: StepCosts) -> None:
        self.index = index
        self.alive = True
        self.admitting = True
        self.num_running = 0
        self.num_waiting = 0
        self.num_blocks: int | None = None
        self.routed_since_stats = 0
        self.flights: dict[str, _Flight] = {}
        self.queued_prefill = 0  # sum of the flights' remaining_prefill, kept as they change
        self.num_free_blocks: int | None = None
        self.unadmitted = 0
        self.unadmitted_blocks = 0
        self.finishes: deque[int] = deque(maxlen=32)  # instants (ns) of the last finishes
        self.blocks_per_finish: float | None = None  # EWMA
        self.mean_output_tokens: float | None = None  # EWMA
        self.inflight: Counter[int] = Counter()
        self.recent: OrderedDict[int, None] = OrderedDict()
        self.adapters: OrderedDict[str, None] = OrderedDict()  # as its slots hold them, least recent first
        self.mirror = KVIndexMirror()
        self.quiet_since_ns: int | None = None  # first frame with work since the last KV batch
        self.fit = StepCostFit(seed)

    def add_flight(self, request_id: str, flight: _Flight) -> None:
        self.drop_flight(request_id)
        self.flights[request_id] = flight
        self.queued_prefill += flight.remaining_prefill
        self.inflight.update(flight.block_hashes)
        self.unadmitted += 1
        self.unadmitted_blocks += flight.blocks_needed

    def admit(self, flight: _Flight) -> None:
        if not flight.admitted:
            flight.admitted = True
            self.unadmitted -= 1
            self.unadmitted_blocks -= flight.blocks_needed

    def finish(self, request_id: str, now_ns: int, block_size: int) -> None:
        flight = self.flights.get(request_id)
        if flight is None:
            return
        self.finishes.append(now_ns)
        freed = -(-(flight.num_prompt_tokens + flight.num_output_tokens) // block_size)
        self.blocks_per_finish = _ewma(self.blocks_per_finish, freed)
        self.mean_output_tokens = _ewma(self.mean_output_tokens, flight.num_output_tokens)
        self.drop_flight(request_id)

    def finish_rate_per_s(self, now_ns: int) -> float | None:
        """Finishes per second over the recent ones, up to now (a replica that stopped finishing decays)."""
        if len(self.finishes) < 2:
            return None
        span = max(now_ns, self.finishes[-1]) - self.finishes[0]
        return (len(self.finishes) - 1) / (span / 1e9) if span > 0 else None

    def set_remaining(self, flight: _Flight, remaining: int) -> None:
        self.queued_prefill += remaining - flight.remaining_prefill
        flight.remaining_prefill = remaining

    def drop_flight(self, request_id: str) -> None:
        flight = self.flights.pop(request_id, None)
        if flight is not None:
            self.admit(flight)
            self.set_remaining(flight, 0)
            self._release_inflight(flight)

    def end_prefill(self, flight: _Flight) -> None:
        if flight.remaining_prefill or flight.block_hashes:  # else ended already: every decode token comes here
            self.set_remaining(flight, 0)
            self._release_inflight(flight)

    def _release_inflight(self, flight: _Flight) -> None:
        if not flight.block_hashes:
            return
        self.inflight.subtract(flight.block_hashes)
        for block_hash in flight.block_hashes:
            if self.inflight[block_hash] <= 0:
                del self.inflight[block_hash]
        flight.block_hashes = ()


class LoadTracker:
    """Per-replica load, step costs and prefix mirrors, fed by the replica set and read by routers.

    Not thread-safe: feed and read it from one thread (the front end's loop). `clock` is in ns and
    only measures staleness (the simulator passes its virtual clock).
    """

    def __init__(self, num_replicas: int, block_size: int, max_staleness_s: float = DEFAULT_MAX_STALENESS_S,
                 *, seed_costs: StepCosts = DEFAULT_STEP_COSTS, clock: Callable[[], int] = time.monotonic_ns,
                 recent_blocks: int = DEFAULT_RECENT_BLOCKS, max_loras: int = 4) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if block_size < 1 or max_staleness_s <= 0 or recent_blocks < 1 or max_loras < 1:
            raise ValueError("block_size, max_staleness_s, recent_blocks and max_loras must be > 0")
        self.max_loras = max_loras  # the replicas' adapter slots (their --max-loras)
        self.block_size = block_size
        self.max_staleness_s = max_staleness_s
        self.clock = clock
        self._seed = seed_costs
        self._recent_blocks = recent_blocks
        self._replicas = [_Replica(i, seed_costs) for i in range(num_replicas)]

    @property
    def num_replicas(self) -> int:
        return len(self._replicas)

    def _replica(self, replica: int) -> _Replica:
        if not 0 <= replica < len(self._replicas):
            raise IndexError(f"no replica {replica} (valid: 0..{len(self._replicas) - 1})")
        return self._replicas[replica]

    # ---- feeding ---------------------------------------------------------------------------------

    def on_routed(self, replica: int, request_id: str, num_prompt_tokens: int, *, num_cached_tokens: int = 0,
                  block_hashes: Sequence[int] = (), lora_name: str | None = None) -> None:
        """A request was sent to `replica`: count it before the replica's next stats say so."""
        state = self._replica(replica)
        state.routed_since_stats += 1
        hashes = tuple(block_hashes)
        uncached = max(0, num_prompt_tokens - num_cached_tokens)
        state.add_flight(request_id, _Flight(num_prompt_tokens, uncached, hashes, -(-uncached // self.block_size),
                                             lora_name=lora_name))
        recent = state.recent
        for block_hash in hashes:
            recent[block_hash] = None
            recent.move_to_end(block_hash)
        bound = state.num_blocks or self._recent_blocks
        while len(recent) > bound:
            recent.popitem(last=False)

    def on_frame(self, replica: int, outputs: CoreOutputs) -> None:
        """One step's outputs of `replica`: its gauges and duration, its KV events, its finished requests."""
        state = self._replica(replica)
        now = self.clock()
        if outputs.kv_events is not None:
            self._apply(state, outputs.kv_events)
            state.quiet_since_ns = None
        elif outputs.num_scheduled and state.quiet_since_ns is None:
            state.quiet_since_ns = now
        record = outputs.record
        if record is not None:
            self._on_record(state, record)
        for out in outputs.outputs:
            flight = state.flights.get(out.request_id)
            if flight is not None and out.new_token_ids:
                flight.num_output_tokens += len(out.new_token_ids)
                state.end_prefill(flight)  # a sampled token: its prompt is computed
            if out.finish_reason is not None:
                state.finish(out.request_id, now, self.block_size)

    def _on_record(self, state: _Replica, record: StepRecord) -> None:
        gauges = record.gauges
        state.num_running, state.num_waiting = gauges.num_running, gauges.num_waiting
        state.num_blocks = gauges.num_blocks or state.num_blocks
        state.num_free_blocks = gauges.num_free_blocks
        state.routed_since_stats = 0
        state.fit.observe(record)
        flights = state.flights
        for chunk in record.scheduled:
            flight = flights.get(chunk.request_id)
            if flight is None:
                continue
            if not flight.admitted:
                state.admit(flight)
            if flight.lora_name is not None:  # the step ran it: its adapter is in a slot there, most recent
                adapters = state.adapters
                adapters[flight.lora_name] = None
                adapters.move_to_end(flight.lora_name)
                if len(adapters) > self.max_loras:
                    adapters.popitem(last=False)
            if chunk.start < chunk.num_prompt_tokens:
                state.set_remaining(flight, max(0, chunk.num_prompt_tokens - chunk.start - chunk.num_tokens))
        for request_id in record.preempted:  # recomputed from scratch (its own prefix may still hit)
            flight = state.flights.get(request_id)
            if flight is not None:
                state.set_remaining(flight, flight.num_prompt_tokens)

    def on_finished(self, replica: int, request_id: str) -> None:
        """A request ended there (its final output was seen, it was aborted, or handed off)."""
        self._replica(replica).finish(request_id, self.clock(), self.block_size)

    def set_admitting(self, replica: int, admitting: bool) -> None:
        """Drain (False) or undrain a replica: a draining replica is never a candidate."""
        self._replica(replica).admitting = admitting

    def set_alive(self, replica: int, alive: bool) -> None:
        """A replica died (False) or a fresh engine replaced it (True: its state starts over)."""
        state = self._replica(replica)
        if alive and not state.alive:
            fresh = _Replica(replica, self._seed)
            fresh.admitting = state.admitting
            self._replicas[replica] = fresh
            return
        state.alive = alive

    # ---- the prefix mirrors ----------------------------------------------------------------------

    def _apply(self, state: _Replica, batch: KVEventBatch) -> None:
        state.mirror.apply(batch)  # a gap leaves it stale until the missing batches or a snapshot

    def mirror(self, replica: int) -> KVIndexMirror:
        """The replica's prefix mirror (e.g. a handoff's skip_hashes)."""
        return self._replica(replica).mirror

    def needs_resync(self, replica: int) -> bool:
        """True after a gap: fetch `kv_events_since(mirror.next_seq)` or a `kv_snapshot` and pass it in."""
        return self._replica(replica).mirror.stale

    def catch_up(self, replica: int, batches: Sequence[KVEventBatch]) -> bool:
        """Apply replayed batches (the engine's `kv_events_since(next_seq)`); True if the gap closed."""
        state = self._replica(replica)
        for batch in batches:
            state.mirror.apply(batch)
        if not state.mirror.stale:
            state.quiet_since_ns = None
        return not state.mirror.stale

    def resync(self, replica: int, snapshot: KVIndexSnapshot, batches_after: Sequence[KVEventBatch] = ()) -> None:
        """Replace the mirror with the engine's `kv_snapshot`, then apply the batches after it."""
        state = self._replica(replica)
        state.mirror.resync(snapshot)
        for batch in batches_after:
            state.mirror.apply(batch)
        state.quiet_since_ns = None

    def staleness_s(self, replica: int) -> float:
        """Seconds the replica has stepped without sending KV events; inf while a gap is open."""
        state = self._replica(replica)
        if state.mirror.stale:
            return math.inf
        if state.quiet_since_ns is None:
            return 0.0
        return max(0, self.clock() - state.quiet_since_ns) / 1e9

    # ---- reading ---------------------------------------------------------------------------------

    def views(self) -> list[ReplicaLoad]:
        """Every replica's load, by index (routers pick among the alive and admitting ones)."""
        out = []
        now = self.clock()
        for state in self._replicas:
            staleness = self.staleness_s(state.index)
            out.append(ReplicaLoad(
                index=state.index, alive=state.alive, admitting=state.admitting,
                num_running=state.num_running, num_waiting=state.num_waiting + state.routed_since_stats,
                queued_prefill_tokens=state.queued_prefill, costs=state.fit.costs, mirror=state.mirror,
                staleness_s=staleness, mirror_trusted=staleness <= self.max_staleness_s,
                num_blocks=state.num_blocks, num_free_blocks=state.num_free_blocks,
                unadmitted=state.unadmitted, unadmitted_blocks=state.unadmitted_blocks,
                finish_rate_per_s=state.finish_rate_per_s(now), blocks_per_finish=state.blocks_per_finish,
                mean_output_tokens=state.mean_output_tokens,
                inflight=state.inflight, recent=state.recent, resident_adapters=state.adapters))
        return out
