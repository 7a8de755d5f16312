"""Handoffs between replicas, as the front door drives them: one request moves from a source core to a
destination core under a lease, stepped one utility answer at a time (the front end's loop never waits).

    precopy   source.precopy_blocks(id, skip)   full blocks, while the request keeps decoding
              destination.import_blocks(blocks) into its prefix cache, unreferenced
    export    source.export_request(id, skip)   the pause starts: the request is EXPORTING, its blocks kept
    import    destination.import_request(snap)  accepted: it runs there now; refused: reason named
    complete  source.complete_export(lease)     the ack: the source drops its references (blocks stay cached)
          or  source.resume_export(lease)       the nack: it runs on the source again

A block is only ever skipped because the destination's KV events say it holds it; if it was evicted
meanwhile, the destination recomputes from what it has (the core's rule), so the copy is an optimisation,
never a correctness condition. Abort at any stage: the front door's FinishRequests goes to both cores, and
each frees what it holds.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tokenloop.cluster.errors import ClusterError
from tokenloop.cluster.members import OwnedRequest, ReplicaHost
from tokenloop.core.kv_cache import block_hash_chain
from tokenloop.core.messages import (
    CallResult,
    FinishRequests,
)
from tokenloop.core.wire import error_from_wire
from tokenloop.observe.records import HandoffRecord
from tokenloop.request import FinishReason

logger = logging.getLogger(__name__)

# Rebalance: a replica with at least this many requests waiting for a slot gives its newest one to a
# replica that has a free slot and nobody waiting (a waiting request moves almost no KV).
REBALANCE_MIN_WAITING = 2
REBALANCE_INTERVAL_NS = 250_000_000
# Pre-copy moves a request's blocks in stages of at most this many: reading and packing a stage stalls the
# source's loop (its other requests too), so a stage stays short however long the context (SmolLM2's fp32
# KV is ~0.74 MB a block of 16 tokens: a stage of 8 is ~6 MB). The tail moves in the pause.
PRECOPY_STAGE_BLOCKS = 8


@dataclass
class Handoff:
    """One request on its way from `source` to `destination`."""

    request_id: str
    source: int
    destination: int
    reason: str
    started_ns: int
    stage: str = "precopy"
    lease_id: str | None = None
    paused_ns: int | None = None
    num_precopied: int = 0
    precopied_hashes: list[int] = field(default_factory=list)
    cancelled: bool = False


@dataclass
class HandoffStats:
    """Counts by outcome (completed, refused, cancelled, failed), what moved, and recent pauses."""

    outcomes: Counter[str] = field(default_factory=Counter)
    bytes_moved: int = 0
    blocks_copied: int = 0
    blocks_matched: int = 0
    blocks_precopied: int = 0
    tokens_recomputed: int = 0
    pauses_ms: deque[float] = field(default_factory=lambda: deque(maxlen=256))

    def as_dict(self) -> dict[str, Any]:
        pauses = sorted(self.pauses_ms)
        return {"outcomes": dict(self.outcomes), "bytes_moved": self.bytes_moved,
                "blocks_copied": self.blocks_copied, "blocks_matched": self.blocks_matched,
                "blocks_precopied": self.blocks_precopied, "tokens_recomputed": self.tokens_recomputed,
                "pause_ms_p50": pauses[len(pauses) // 2] if pauses else None,
                "pause_ms_max": pauses[-1] if pauses else None}


class HandoffFlow:
    """The handoffs in flight in one replica set, and their lifetime counts."""

    def __init__(self, replicas: ReplicaHost, *, lease_s: float = 30.0, precopy: bool = True,
                 stage_blocks: int = PRECOPY_STAGE_BLOCKS) -> None:
        self.set = replicas
        self.lease_s = lease_s
        self.precopy = precopy
        self.stage_blocks = stage_blocks
        self.in_flight: dict[str, Handoff] = {}
        self.stats = HandoffStats()
        self._handed_off: set[str] = set()  # disaggregation moves a request once
        self._last_rebalance_ns = 0
        self.rebalance_interval_ns = REBALANCE_INTERVAL_NS  # between two looks at the queues

    # ---- asked by the replica set --------------------------------------------------------------------

    def replicas_holding(self, request_id: str, owner: int) -> list[int]:
        handoff = self.in_flight.get(request_id)
        if handoff is None:
            return [owner]
        return sorted({handoff.source, handoff.destination})

    def cancel(self, request_id: str) -> None:
        handoff = self.in_flight.pop(request_id, None)
        if handoff is not None:
            handoff.cancelled = True
            self._record(handoff, "cancelled")
        self._handed_off.discard(request_id)

    def forget(self, request_id: str) -> None:
        """The request finished: a handoff still in flight has nothing left to move."""
        handoff = self.in_flight.pop(request_id, None)
        if handoff is not None:
            handoff.cancelled = True
            self._record(handoff, "finished")
        self._handed_off.discard(request_id)

    def on_progress(self, request_id: str, owned: OwnedRequest) -> None:
        """Prefill/decode disaggregation: once a prefill replica produced the first token, hand it off."""
        k = self.set.prefill_replicas
        if not k or owned.replica >= k or not owned.output_token_ids:
            return
        if request_id in self.in_flight or request_id in self._handed_off:
            return
        destination = self.least_loaded(range(k, len(self.set.replicas)))
        if destination is not None:
            self._handed_off.add(request_id)
            self.start(request_id, destination, "disaggregation")

    def rebalance(self, max_num_seqs: int) -> Handoff | None:
        """One step of load balancing (Llumnix-style, on queues): move the newest request of the most
        backed-up replica to one with room, one handoff at a time. Returns the handoff it started."""
        now = self.set.clock()
        if now - self._last_rebalance_ns < self.rebalance_interval_ns:
            return None
        self._last_rebalance_ns = now
        if any(h.reason == "rebalance" for h in self.in_flight.values()):
            return None
        views = [v for v in self.set.tracker.views() if v.alive and v.admitting]
        if len(views) < 2:
            return None
        busiest = max(views, key=lambda v: (v.num_waiting, v.num_running, -v.index))
        roomiest = min(views, key=lambda v: (v.num_waiting, v.num_running, v.index))
        if (busiest.num_waiting < REBALANCE_MIN_WAITING or roomiest.num_waiting > 0
                or roomiest.num_running >= max_num_seqs or busiest.index == roomiest.index):
            return None
        candidates = [rid for rid in self.set.requests_on(busiest.index) if rid not in self.in_flight]
        if not candidates:
            return None
        return self.start(candidates[-1], roomiest.index, "rebalance")

    def on_death(self, index: int) -> None:
        """A replica died: handoffs from it are over (failover has its requests); handoffs to it resume
        on their source."""
        for request_id, handoff in list(self.in_flight.items()):
            if handoff.source == index:
                del self.in_flight[request_id]
                self._record(handoff, "failed", f"source replica {index} died")
            elif handoff.destination == index:
                del self.in_flight[request_id]
                self._resume(handoff, f"destination replica {index} died")

    # ---- the protocol ----------------------------------------------------------------------------------

    def start(self, request_id: str, destination: int, reason: str) -> Handoff:
        """Begin moving one request (raises ClusterError when it cannot move there)."""
        s = self.set
        owned = s.owned(request_id)
        if owned is None:
            raise ClusterError(f"request {request_id!r} is not running in this cluster", status=404)
        if request_id in self.in_flight:
            raise ClusterError(f"request {request_id!r} is already being handed off")
        target = s.replica(destination)
        if not target.alive:
            raise ClusterError(f"replica {destination} is not alive")
        if destination == owned.replica:
            raise ClusterError(f"request {request_id!r} already runs on replica {destination}")
        handoff = Handoff(request_id, owned.replica, destination, reason, s.clock())
        self.in_flight[request_id] = handoff
        self._record(handoff, "exporting")
        if self.precopy:
            self._precopy_stage(handoff)
        else:
            self._export(handoff)
        return handoff

    def _precopy_stage(self, handoff: Handoff) -> None:
        owned = self.set.owned(handoff.request_id)
        if not self._live(handoff) or owned is None:
            return
        self.set.call(handoff.source, "precopy_blocks",
                      [handoff.request_id, self._skip(handoff, owned), self.stage_blocks],
                      lambda result: self._precopied(handoff, result))

    def _live(self, handoff: Handoff) -> bool:
        return not handoff.cancelled and self.in_flight.get(handoff.request_id) is handoff

    def _skip(self, handoff: Handoff, owned: OwnedRequest) -> list[int]:
        """The request's full blocks the destination already holds (by its KV events)."""
        tokens = [*owned.request.prompt_token_ids, *owned.output_token_ids]
        held = self.set.tracker.mirror(handoff.destination).hashes
        precopied = set(handoff.precopied_hashes)
        return [h for h in block_hash_chain(tokens, self.set.info.block_size, owned.request.cache_salt)
                if h in held or h in precopied]

    def _precopied(self, handoff: Handoff, result: CallResult) -> None:
        if not self._live(handoff):
            return
        blocks = result.value if result.error is None else None
        if not blocks:
            self._export(handoff)
            return
        handoff.num_precopied += len(blocks)
        handoff.precopied_hashes.extend(b.block_hash for b in blocks if b.block_hash is not None)
        moved = sum(len(b.data) for b in blocks)
        self.stats.blocks_precopied += len(blocks)
        self.stats.bytes_moved += moved
        self._record(handoff, "precopied", blocks_copied=len(blocks), bytes_moved=moved)
        # A full stage: there may be more (the request kept decoding, too); a short one was the last.
        after = self._precopy_stage if len(blocks) >= self.stage_blocks else self._export
        self.set.call(handoff.destination, "import_blocks", [blocks], lambda _: after(handoff))

    def _export(self, handoff: Handoff) -> None:
        if not self._live(handoff):
            return
        owned = self.set.owned(handoff.request_id)
        if owned is None:
            return
        handoff.stage, handoff.paused_ns = "export", self.set.clock()
        self._record(handoff, "paused")  # the request's stream stops here until it is imported
        self.set.call(handoff.source, "export_request",
                      [handoff.request_id, self._skip(handoff, owned), self.lease_s],
                      lambda result: self._exported(handoff, result))

    def _exported(self, handoff: Handoff, result: CallResult) -> None:
        if not self._live(handoff):
            return  # aborted meanwhile: the abort reached the source after the export, which freed it
        if result.error is not None:
            del self.in_flight[handoff.request_id]
            self._record(handoff, "failed", str(error_from_wire(result.error)))
            return
        snapshot = result.value
        handoff.stage, handoff.lease_id = "import", snapshot.lease_id
        self._record(handoff, "in_transit")
        self.set.call(handoff.destination, "import_request", [snapshot],
                      lambda answer: self._imported(handoff, answer))

    def _imported(self, handoff: Handoff, result: CallResult) -> None:
        if not self._live(handoff):
            return  # aborted: the FinishRequests went to both cores after these calls, each freed its part
        imported = result.value if result.error is None else None
        if imported is None or not imported.accepted:
            reason = (imported.reason if imported is not None
                      else str(error_from_wire(result.error)))  # type: ignore[arg-type]
            del self.in_flight[handoff.request_id]
            self._resume(handoff, reason)
            return
        s = self.set
        owned = s.owned(handoff.request_id)
        if owned is not None:  # its outputs come from the destination from now on
            owned.replica = handoff.destination
            s.tracker.on_finished(handoff.source, handoff.request_id)
            s.tracker.on_routed(handoff.destination, handoff.request_id, imported.num_tokens_recomputed)
            if owned.route is not None:
                owned.route = {**owned.route, "replica": handoff.destination}
        stats = self.stats
        stats.blocks_copied += imported.num_blocks_copied
        stats.blocks_matched += imported.num_blocks_matched
        stats.tokens_recomputed += imported.num_tokens_recomputed
        stats.bytes_moved += imported.bytes_copied
        if handoff.paused_ns is not None:
            stats.pauses_ms.append((s.clock() - handoff.paused_ns) / 1e6)
        handoff.stage = "complete"
        self._record(handoff, "imported", blocks_copied=imported.num_blocks_copied,
                     blocks_matched=imported.num_blocks_matched, bytes_moved=imported.bytes_copied)
        s.call(handoff.source, "complete_export", [handoff.lease_id],
               lambda answer: self._completed(handoff, answer))

    def _completed(self, handoff: Handoff, result: CallResult) -> None:
        if self.in_flight.get(handoff.request_id) is handoff:
            del self.in_flight[handoff.request_id]
        if result.error is None and result.value:
            self._record(handoff, "completed")
            return
        # The source no longer held the lease (it expired and the request resumed there): two cores
        # would run it. Stop both rather than stream a mix; the client gets a clear error.
        why = "the handoff's lease expired on the source before the destination's ack"
        logger.error("request %s: %s", handoff.request_id, why)
        s = self.set
        s.send_to(handoff.source, [FinishRequests([handoff.request_id], FinishReason.ABORT)])
        s.send_to(handoff.destination, [FinishRequests([handoff.request_id], FinishReason.ABORT)])
        s.fail(handoff.request_id, why)
        self._record(handoff, "failed", why)

    def _resume(self, handoff: Handoff, reason: str | None) -> None:
        """The destination refused (or died): the request runs on its source again."""
        if handoff.lease_id is not None and self.set.replicas[handoff.source].alive:
            self.set.call(handoff.source, "resume_export", [handoff.lease_id], lambda _: None)
        self._record(handoff, "refused", reason)

    def least_loaded(self, indices: Iterable[int]) -> int | None:
        """The alive replica among `indices` with the fewest running and waiting requests."""
        views = {v.index: v for v in self.set.tracker.views()}
        alive = [i for i in indices if self.set.replicas[i].alive]
        if not alive:
            return None
        return min(alive, key=lambda i: (views[i].num_running + views[i].num_waiting, i))

    def _record(self, handoff: Handoff, event: str, detail: str | None = None, *,
                blocks_copied: int = 0, blocks_matched: int = 0, bytes_moved: int = 0) -> None:
        """Count an outcome and tell the observers (a lifecycle transition of its own in traces)."""
        if event in ("completed", "refused", "cancelled", "failed", "finished"):
            self.stats.outcomes[event] += 1
        record = HandoffRecord(handoff.request_id, event, handoff.source, handoff.destination,
                               handoff.reason, self.set.clock(), detail, blocks_copied, blocks_matched,
                               bytes_moved)
        self.set.emit_handoff(record)
