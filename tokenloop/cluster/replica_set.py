"""ReplicaSet: N engine cores behind one front door, as one `CoreClient`.

The front end's loop (`serving/front_loop.py`) drives a ReplicaSet exactly as it drives one core client:

    send(messages)  an AddRequests goes to the replica the router picks (all of one submission to one
                    replica: all-or-none stays one core's rule); a FinishRequests to the replicas that hold
                    those ids; a utility call to every live replica, the answers merged; a call named in
                    `CLUSTER_CALLS` is answered here (replica status, drain, undrain, migrate)
    receive()       every replica's frames, their records tagged with the replica's index, fed to the
                    `LoadTracker` the router reads; frames this set makes itself (failover finals)
    death()         only when no replica is left alive

It owns the cluster's request state (which replica holds which core request, the tokens each produced so
far, handoffs in flight) and nothing of the core's: handoffs are named utility calls on the two cores
(`tokenloop.core.handoff`), stepped here one answer at a time, so the front end's loop never blocks.

Long module: one class, `ReplicaSet`, and the state all its methods share (the replicas, the requests
each owns, the gathers in flight, the restarts); the rooms that only act on it (admin.py, handoff_flow.py)
are split off already.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenloop.cluster.admin import CLUSTER_CALLS
from tokenloop.cluster.errors import ClusterError
from tokenloop.cluster.handoff_flow import HandoffFlow, HandoffStats
from tokenloop.cluster.load import LoadTracker
from tokenloop.cluster.members import OwnedRequest, Replica
from tokenloop.cluster.router import Dispatcher, Router, RouteRequest
from tokenloop.cluster.runtime_adapters import MERGE as LORA_MERGE
from tokenloop.cluster.runtime_adapters import RuntimeAdapters
from tokenloop.core.messages import (
    AddRequests,
    CallResult,
    CoreError,
    CoreFrame,
    CoreOutput,
    CoreOutputs,
    FinishRequests,
    InputMessage,
    Shutdown,
    UtilityCall,
)
from tokenloop.core.wire import error_from_wire, error_to_wire
from tokenloop.errors import CapacityError, InvalidRequestError, TokenloopError
from tokenloop.observe.records import HandoffRecord
from tokenloop.request import FinishReason, default_clock

logger = logging.getLogger(__name__)

FAILOVER_MODES = ("fail", "recompute")

# How answers of one utility from every replica become one answer (the default: replica 0's).
_MERGE: dict[str, Callable[[list[Any]], Any]] = {
    "has_unfinished_requests": any,
    "num_unfinished_requests": sum,
    "num_steps": sum,
    "holds_blocks": any,
    "ping": all,
    "kv_usage": lambda values: sum(values) / len(values),
    "idle": lambda values: [any(v[0] for v in values), max(v[1] for v in values)],
}


def _merge_kv_facts(values: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for key in ("unfinished", "free_blocks", "num_blocks", "preemptions", "steps"):
        merged[key] = sum(v[key] for v in values)
    merged["kv_usage"] = 1.0 - merged["free_blocks"] / merged["num_blocks"] if merged["num_blocks"] else 0.0
    merged["replicas"] = values
    return merged


_MERGE["kv_facts"] = _merge_kv_facts
_MERGE.update(LORA_MERGE)


@dataclass
class _Gather:
    """A utility call broadcast to several replicas, answered once every one of them has answered."""

    call_id: int
    name: str
    args: list[Any]
    waiting: set[int]
    values: dict[int, Any] = field(default_factory=dict)
    error: CoreError | None = None


class ReplicaSet:
    """N core clients behind the `CoreClient` protocol, with a router, failover and handoffs."""

    is_replica_set = True  # the admin routes and the dashboard ask this of a client

    def __init__(self, clients: Sequence[Any], router: Router, tracker: LoadTracker, *,
                 failover: str = "fail", restart: Callable[[int], Any] | None = None,
                 prefill_replicas: int = 0, lease_s: float = 30.0, precopy: bool = True,
                 rebalance_max_num_seqs: int | None = None) -> None:
        if not clients:
            raise ValueError("a replica set needs at least one core client")
        if failover not in FAILOVER_MODES:
            raise InvalidRequestError(f"unknown failover mode {failover!r}; known: {', '.join(FAILOVER_MODES)}")
        if not 0 <= prefill_replicas < len(clients):
            raise InvalidRequestError(f"--prefill-replicas must be in [0, {len(clients)}) with "
                                      f"{len(clients)} replicas")
        infos = [c.info for c in clients]
        first = infos[0]
        for i, info in enumerate(infos[1:], 1):
            if (info.block_size, info.vocab_size, info.max_model_len) != (
                    first.block_size, first.vocab_size, first.max_model_len):
                raise InvalidRequestError(f"replica {i} does not match replica 0 (block size, vocabulary or "
                                          "context length): every replica must serve the same model alike")
        self.info = first
        self.replicas = [Replica(i, c) for i, c in enumerate(clients)]
        self.router = router
        self.tracker = tracker
        self.dispatcher = Dispatcher(router, tracker)  # routes, and counts the request where it went
        self.failover = failover
        self.prefill_replicas = prefill_replicas
        self._restart = restart
        self.clock = default_clock
        self._owned: dict[str, OwnedRequest] = {}  # core request id -> where it runs
        self._adds: dict[int, tuple[int, AddRequests]] = {}  # front-end call id -> (replica, unanswered add)
        self._gathers: dict[int, _Gather] = {}  # internal call id -> broadcast in progress
        self._internal: dict[int, tuple[int, Callable[[CallResult], None]]] = {}  # id -> (replica, callback)
        self._next_internal_id = 0
        self._frames: list[CoreFrame] = []  # made here (failover finals, cluster-call answers)
        self._results: list[CallResult] = []
        self._handoff_records: list[HandoffRecord] = []
        self._restarted: list[tuple[int, Any, BaseException | None]] = []  # from restart threads
        self._restart_lock = threading.Lock()
        self._wake_read, self._wake_write = os.pipe()  # a restart thread wakes the front end's poller
        os.set_blocking(self._wake_read, False)
        self.handoffs = HandoffFlow(self, lease_s=lease_s, precopy=precopy)
        # Set: requests queued behind a full replica move to one with a free slot (of this many).
        self.rebalance_max_num_seqs = rebalance_max_num_seqs
        self.adapters = RuntimeAdapters()  # LoRA adapters loaded at run time: on every replica or none
        self._closed = False
        self.on_close: list[Callable[[], None]] = []  # run after every replica closed (stop Ray we started)
        for replica in self.replicas:
            # With a prefill group, new work goes to it; the decode group takes requests by handoff only.
            replica.admitting = replica.index < prefill_replicas if prefill_replicas else True
            tracker.set_alive(replica.index, True)
            tracker.set_admitting(replica.index, replica.admitting)

    # ---- the CoreClient protocol --------------------------------------------------------------------

    def send(self, messages: list[InputMessage]) -> None:
        out: dict[int, list[InputMessage]] = {}
        for message in messages:
            if isinstance(message, AddRequests):
                self._route(message, out)
            elif isinstance(message, FinishRequests):
                self._finish(message, out)
            elif isinstance(message, UtilityCall):
                self._utility(message, out)
            elif isinstance(message, Shutdown):
                for replica in self._live():
                    out.setdefault(replica.index, []).append(message)
            else:
                raise TypeError(f"not an engine-core message: {type(message).__name__}")
        self._send_all(out)

    def receive(self) -> list[CoreFrame]:
        frames, self._frames = self._frames, []
        self._take_restarts()
        for replica in self.replicas:
            if not replica.alive:
                continue
            try:
                received = replica.client.receive()
            except Exception:
                if replica.client.death() is None:
                    raise
                received = []
            for frame in received:
                kept = self._on_frame(replica.index, frame)
                if kept is not None:
                    frames.append(kept)
            why = replica.client.death()
            if why is not None:
                self._on_death(replica, why)
        if self.rebalance_max_num_seqs is not None and self._owned:
            try:
                self.handoffs.rebalance(self.rebalance_max_num_seqs)
            except TokenloopError as exc:  # a request that just finished: try again next time
                logger.debug("rebalance skipped: %s", exc)
        frames.extend(self._frames)
        self._frames = []
        if self._handoff_records:
            frames.append(CoreFrame(CoreOutputs([], self.clock(), 0, handoffs=self._handoff_records)))
            self._handoff_records = []
        if self._results:
            frames.append(CoreFrame(None, self._results))
            self._results = []
        return frames

    def pollables(self) -> list[Any]:
        items: list[Any] = [self._wake_read]
        for replica in self._live():
            items.extend(replica.client.pollables())
        return items

    def poll_timeout_ms(self) -> int | None:
        if self._frames or self._results or self._restarted or self._handoff_records:
            return 0
        timeouts = [t for r in self._live() if (t := r.client.poll_timeout_ms()) is not None]
        return min(timeouts) if timeouts else None

    def death(self) -> str | None:
        if any(r.alive for r in self.replicas) or self._restart_pending():
            return None
        reasons = "; ".join(f"replica {r.index}: {r.death}" for r in self.replicas)
        return f"every engine replica died ({reasons})"

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        for replica in self.replicas:
            try:
                replica.client.close(timeout_s)
            except Exception:
                logger.exception("closing replica %d failed", replica.index)
        for close in self.on_close:
            try:
                close()
            except Exception:
                logger.exception("stopping the cluster failed")
        for fd in (self._wake_read, self._wake_write):
            try:
                os.close(fd)
            except OSError:
                pass

    # ---- what the set tracks -------------------------------------------------------------------------

    def owner(self, request_id: str) -> int | None:
        owned = self._owned.get(request_id)
        return owned.replica if owned is not None else None

    def owned(self, request_id: str) -> OwnedRequest | None:
        return self._owned.get(request_id)

    def fail(self, request_id: str, why: str) -> None:
        """End a request the set can no longer run: it leaves the set, its stream gets `why` as an error
        (in the next frame; the cores hold nothing of it, or are told to drop it by the caller)."""
        owned = self._owned.pop(request_id, None)
        if owned is None:
            return
        self.tracker.on_finished(owned.replica, request_id)
        failed = CoreOutput(request_id, [], finish_reason=FinishReason.ERROR, error=why)
        self._frames.append(CoreFrame(CoreOutputs([failed], self.clock(), 0)))

    def request_ids(self) -> list[str]:
        return list(self._owned)

    def requests_on(self, index: int) -> list[str]:
        return [rid for rid, owned in self._owned.items() if owned.replica == index]

    def _live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def replica(self, index: int) -> Replica:
        if not 0 <= index < len(self.replicas):
            raise ClusterError(f"no replica {index}: the valid indices are 0..{len(self.replicas) - 1}",
                               status=404)
        return self.replicas[index]

    # ---- messages out --------------------------------------------------------------------------------

    def _send_all(self, out: dict[int, list[InputMessage]]) -> None:
        for index, batch in out.items():
            replica = self.replicas[index]
            if replica.alive and batch:
                try:
                    replica.client.send(batch)
                except Exception as exc:  # noqa: BLE001 - a dead socket: its death is noticed on receive
                    logger.warning("sending to replica %d failed: %s", index, exc)

    def call(self, index: int, name: str, args: list[Any], callback: Callable[[CallResult], None]) -> None:
        """One named utility on one replica; `callback` gets its answer (or an error if it died first)."""
        self._next_internal_id -= 1  # negative: never a front-end call id
        call_id = self._next_internal_id
        self._internal[call_id] = (index, callback)
        self._send_all({index: [UtilityCall(call_id, name, args)]})

    def send_to(self, index: int, messages: list[InputMessage]) -> None:
        self._send_all({index: messages})

    def _route(self, message: AddRequests, out: dict[int, list[InputMessage]]) -> None:
        requests = message.requests
        first = requests[0]
        try:
            decision = self.dispatcher.dispatch(
                RouteRequest(first.request_id, first.prompt_token_ids, first.cache_salt, first.user,
                             lora_name=first.lora_name))
        except TokenloopError as exc:
            self._results.append(CallResult(message.call_id, None, error_to_wire(
                exc if isinstance(exc, CapacityError) else CapacityError(str(exc), retry_after_s=1.0))))
            return
        index = decision.replica
        route = {"replica": index, "policy": decision.policy, "predicted_ttft_s": decision.predicted_ttft_s,
                 "cached_tokens": decision.cached_tokens}
        for request in requests:
            self._owned[request.request_id] = OwnedRequest(request, index, route=route)
            if request is not first:  # the dispatcher counted the first; n > 1 samples share its prompt
                self.tracker.on_routed(index, request.request_id, len(request.prompt_token_ids),
                                       num_cached_tokens=decision.cached_tokens)
        self._adds[message.call_id] = (index, message)
        out.setdefault(index, []).append(message)

    def _finish(self, message: FinishRequests, out: dict[int, list[InputMessage]]) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in message.request_ids:
            owned = self._owned.get(request_id)
            if owned is None:
                continue
            for index in self.handoffs.replicas_holding(request_id, owned.replica):
                by_replica.setdefault(index, []).append(request_id)
            self.handoffs.cancel(request_id)
        for index, ids in by_replica.items():
            out.setdefault(index, []).append(dataclasses.replace(message, request_ids=ids))

    def _utility(self, message: UtilityCall, out: dict[int, list[InputMessage]]) -> None:
        handler = CLUSTER_CALLS.get(message.name)
        if handler is not None:
            try:
                self._results.append(CallResult(message.call_id, handler(self, *message.args)))
            except Exception as exc:  # noqa: BLE001 - the caller raises it again
                self._results.append(CallResult(message.call_id, None, error_to_wire(exc)))
            return
        live = self._live()
        if not live:
            self._results.append(CallResult(message.call_id, None, CoreError(
                "EngineStoppedError", "no engine replica is alive")))
            return
        self._next_internal_id -= 1
        gather = _Gather(message.call_id, message.name, list(message.args), {r.index for r in live})
        self._gathers[self._next_internal_id] = gather
        for replica in live:
            out.setdefault(replica.index, []).append(
                UtilityCall(self._next_internal_id, message.name, message.args))

    # ---- frames in -----------------------------------------------------------------------------------

    def _on_frame(self, index: int, frame: CoreFrame) -> CoreFrame | None:
        results = []
        for result in frame.results:
            if result.call_id in self._internal:
                _, callback = self._internal.pop(result.call_id)
                callback(result)
            elif result.call_id in self._gathers:
                self._gathered(index, result)
            else:
                self._answered_add(result)
                results.append(result)
        outputs = frame.outputs
        if outputs is not None:
            self._tag(index, outputs)
            self.tracker.on_frame(index, outputs)
            kept = []
            for output in outputs.outputs:
                owned = self._owned.get(output.request_id)
                if owned is None or owned.replica != index:
                    continue  # aborted here already, or a stale final from a handoff's source
                owned.output_token_ids.extend(output.new_token_ids)
                if output.finished:
                    del self._owned[output.request_id]
                    self.tracker.on_finished(index, output.request_id)
                    self.handoffs.forget(output.request_id)
                else:
                    self.handoffs.on_progress(output.request_id, owned)
                kept.append(output)
            outputs.outputs = kept
            if outputs.kv_events is not None and self.tracker.needs_resync(index):
                self._resync(index)
        if outputs is None and not results:
            return None
        return CoreFrame(outputs, results)

    def _tag(self, index: int, outputs: CoreOutputs) -> None:
        if outputs.record is not None:
            outputs.record.replica = index
        for arrival in outputs.arrivals:
            arrival.replica = index
            owned = self._owned.get(arrival.request_id)
            if owned is not None:
                arrival.route = owned.route
        for release in outputs.releases:
            release.replica = index
        if outputs.record is not None:
            for release in outputs.record.releases:
                release.replica = index

    def _resync(self, index: int) -> None:
        def done(result: CallResult) -> None:
            if result.error is None and result.value is not None:
                self.tracker.resync(index, result.value)

        self.call(index, "kv_snapshot", [], done)

    def _answered_add(self, result: CallResult) -> None:
        added = self._adds.pop(result.call_id, None)
        if added is None or result.error is None:
            return
        index, message = added
        for request_id in (r.request_id for r in message.requests):  # refused all-or-none: none runs anywhere
            if self._owned.pop(request_id, None) is not None:
                self.tracker.on_finished(index, request_id)

    def _gathered(self, index: int, result: CallResult) -> None:
        gather = self._gathers[result.call_id]
        gather.waiting.discard(index)
        if result.error is not None:
            gather.error = result.error
        else:
            gather.values[index] = result.value
        if not gather.waiting:
            self._complete_gather(result.call_id)

    def _complete_gather(self, internal_id: int) -> None:
        gather = self._gathers.pop(internal_id)
        for index, name, args in self.adapters.answered(gather.name, gather.args, sorted(gather.values),
                                                        gather.error is not None):
            self.call(index, name, args, self._log_failed_call)
        if gather.error is not None:
            self._results.append(CallResult(gather.call_id, None, gather.error))
            return
        values = [gather.values[i] for i in sorted(gather.values)]
        merge = _MERGE.get(gather.name)
        try:
            value = merge(values) if merge is not None and values else (values[0] if values else None)
        except Exception as exc:  # noqa: BLE001 - answers the caller, never the loop
            self._results.append(CallResult(gather.call_id, None, error_to_wire(exc)))
            return
        self._results.append(CallResult(gather.call_id, value))

    # ---- a replica died ------------------------------------------------------------------------------

    def _on_death(self, replica: Replica, why: str) -> None:
        if not replica.alive:
            return
        replica.alive, replica.death = False, why
        self.tracker.set_alive(replica.index, False)
        logger.error("replica %d died: %s; %s its requests", replica.index, why,
                     "recomputing" if self.failover == "recompute" else "failing")
        index = replica.index
        for internal_id, (target, callback) in list(self._internal.items()):
            if target == index:
                del self._internal[internal_id]
                callback(CallResult(internal_id, None, CoreError("EngineStoppedError", why)))
        for internal_id, gather in list(self._gathers.items()):
            if index in gather.waiting:
                gather.waiting.discard(index)
                if not gather.waiting:
                    self._complete_gather(internal_id)
        rerouted: dict[int, list[InputMessage]] = {}
        for call_id, (target, message) in list(self._adds.items()):
            if target != index:
                continue
            del self._adds[call_id]
            for request in message.requests:
                self._owned.pop(request.request_id, None)
            if self.failover == "recompute":  # nothing of it ran anywhere else: route it again
                self._route(message, rerouted)
            else:  # never answered: refuse it so the submitter does not wait forever
                self._results.append(CallResult(call_id, None, CoreError(
                    "RequestFailedError", f"engine replica {index} died before it accepted the request")))
        self._send_all(rerouted)
        self.handoffs.on_death(index)
        for request_id in self.requests_on(index):
            owned = self._owned[request_id]
            if self.failover == "recompute" and self._resume_elsewhere(owned):
                continue
            self.fail(request_id, f"engine replica {index} died: {why}")
        try:
            replica.client.close(1.0)
        except Exception:  # noqa: BLE001 - it is dead already
            pass
        if self._restart is not None and not self._closed:
            self._start_restart(index)

    def _resume_elsewhere(self, owned: OwnedRequest) -> bool:
        """Run a request again on another replica from its token ids (prompt + what it produced)."""
        request = owned.request
        params = request.params
        done = len(owned.output_token_ids)
        left = (params.max_tokens or 1) - done
        if left <= 0:
            return False
        resumed = dataclasses.replace(
            request, prompt_token_ids=[*request.prompt_token_ids, *owned.output_token_ids],
            params=dataclasses.replace(params, max_tokens=left, min_tokens=max(0, params.min_tokens - done)),
            structured_replay=list(owned.output_token_ids) if params.structured_outputs is not None else None)
        try:
            decision = self.dispatcher.dispatch(RouteRequest(request.request_id, resumed.prompt_token_ids,
                                                             request.cache_salt, request.user,
                                                             lora_name=request.lora_name))
        except TokenloopError:
            return False
        self.tracker.on_finished(owned.replica, request.request_id)
        index = decision.replica
        self._owned[request.request_id] = OwnedRequest(request, index, list(owned.output_token_ids),
                                                       route={**(owned.route or {}), "replica": index,
                                                              "resumed_from": owned.replica})

        def accepted(result: CallResult) -> None:
            if result.error is None:
                return
            self.fail(request.request_id, f"resuming on replica {index} failed: {error_from_wire(result.error)}")

        self._next_internal_id -= 1
        call_id = self._next_internal_id
        self._internal[call_id] = (index, accepted)
        self._send_all({index: [AddRequests(call_id, [resumed])]})
        return True

    # ---- restarting a dead replica -------------------------------------------------------------------

    def _restart_pending(self) -> bool:
        return self._restart is not None and any(r.death == "restarting" for r in self.replicas)

    def _start_restart(self, index: int) -> None:
        restart = self._restart
        assert restart is not None

        def build() -> None:
            client, error = None, None
            try:
                client = restart(index)
            except BaseException as exc:  # noqa: BLE001 - reported on the front end's thread
                error = exc
            with self._restart_lock:
                self._restarted.append((index, client, error))
            try:
                os.write(self._wake_write, b"\0")
            except OSError:
                pass

        threading.Thread(target=build, name=f"tokenloop-restart-{index}", daemon=True).start()

    def _take_restarts(self) -> None:
        if not self._restarted:  # the common turn: no syscall, no lock (a restart thread appends, then wakes us)
            return
        try:
            while os.read(self._wake_read, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        with self._restart_lock:
            restarted, self._restarted = self._restarted, []
        for index, client, error in restarted:
            replica = self.replicas[index]
            if client is None or self._closed:
                logger.error("restarting replica %d failed: %s", index, error)
                if client is not None:
                    client.close(1.0)
                continue
            replica.client, replica.alive, replica.death = client, True, None
            replica.restarts += 1
            for _, name, args in self.adapters.replays(index):  # before the router sees it alive
                self.call(index, name, args, self._log_failed_call)
            self.tracker.set_alive(index, True)
            logger.warning("replica %d restarted (restart #%d)", index, replica.restarts)

    @staticmethod
    def _log_failed_call(result: CallResult) -> None:
        """The answer to a call the set made on its own (nobody waits for it): logged if it failed."""
        if result.error is not None:
            logger.error("a replica refused a call the replica set made: %s", result.error)

    # ---- status --------------------------------------------------------------------------------------

    def status(self) -> list[dict[str, Any]]:
        views = {v.index: v for v in self.tracker.views()}
        rows = []
        for replica in self.replicas:
            view = views.get(replica.index)
            rows.append({
                "index": replica.index, "alive": replica.alive, "admitting": replica.admitting,
                "death": replica.death, "restarts": replica.restarts,
                "role": ("prefill" if replica.index < self.prefill_replicas else "decode")
                if self.prefill_replicas else "mixed",
                "requests": len(self.requests_on(replica.index)),
                "num_running": getattr(view, "num_running", None),
                "num_waiting": getattr(view, "num_waiting", None),
                "pid": getattr(replica.client.info, "pid", None),
            })
        return rows

    def handoff_stats(self) -> HandoffStats:
        return self.handoffs.stats

    def emit_handoff(self, record: HandoffRecord) -> None:
        """A handoff's lifecycle transition, to the front end's observers with the next frame."""
        self._handoff_records.append(record)
