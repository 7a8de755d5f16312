"""One turn of the engine core's loop as messages: apply what came in, step, answer with one frame.

`CoreLoop` is what both core clients drive: the engine process (`core_process`) around sockets, and the
in-process client directly, so the two modes share every rule (all-or-none adds, finals of finished
requests in the next frame, answers in the order the calls came).

A submission whose grammar is not compiled yet is parked while a worker thread compiles it, and added (or
refused, with the compile error as its answer) on the first turn after; the loop steps the others meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenloop.core.heartbeat import Progress
from tokenloop.core.messages import (
    AddRequests,
    CallResult,
    CoreFrame,
    CoreOutput,
    CoreOutputs,
    FinishRequests,
    InputMessage,
    Shutdown,
    UtilityCall,
)
from tokenloop.core.wire import error_to_wire
from tokenloop.errors import EngineStoppedError
from tokenloop.observe.records import ArrivalRecord, ReleaseInfo, StepRecord
from tokenloop.request import FinishReason

if TYPE_CHECKING:  # the front end imports this module (RecordBuffer) without the engine
    import torch

    from tokenloop.core.engine_core import EngineCore

logger = logging.getLogger(__name__)


def _kv_facts(core: EngineCore) -> dict[str, Any]:
    """The pool's state for soak tests and health checks; raises if its invariants are broken."""
    kv = core.kv_cache
    kv.check_invariants([])
    stats = core.stats()
    return {"unfinished": core.num_unfinished_requests, "kv_usage": kv.usage,
            "free_blocks": kv.num_free_blocks,
            "num_blocks": kv.num_blocks, "preemptions": stats.num_preemptions,
            "prefix_cache_hit_rate": round(stats.prefix_cache_hit_rate, 3), "steps": core.num_steps}


# The calls a front end may make across the process boundary: name -> fn(core, *args). Results are plain
# values or wire dataclasses.
# Fault injection for a core that the caller cannot reach by utility (a `tokenloop serve` started by a test or
# the soak): the environment sets the step delay the core process starts with.
STEP_DELAY_ENV = "TOKENLOOP_INJECT_STEP_DELAY_S"


def inject_faults_from_env(core: EngineCore) -> None:
    """Apply the fault injection that the environment asks for (none unless `STEP_DELAY_ENV` is set)."""
    delay = os.environ.get(STEP_DELAY_ENV)
    if delay:
        _inject_step_delay(core, float(delay))


def _inject_step_delay(core: EngineCore, seconds: float) -> None:
    if not 0.0 <= seconds <= 60.0:
        raise ValueError(f"inject_step_delay takes 0-60 s, not {seconds!r}")
    core.injected_step_delay_s = float(seconds)


class _SlowLayers:
    """Fault injection: a model whose every layer takes `delay_s` longer, ticking its progress as it goes."""

    def __init__(self, progress: Progress, delay_s: float) -> None:
        self.progress, self.delay_s = progress, delay_s

    @property
    def layer_ticks(self) -> torch.Tensor | None:
        return self.progress.layer_ticks

    def tick(self) -> None:
        time.sleep(self.delay_s)
        self.progress.tick()


def _inject_layer_delay(core: EngineCore, seconds: float) -> None:
    """Every layer of the model's Python forward sleeps `seconds` first: a slow model, whose long steps
    still show progress layer by layer (the fused one-call decode path has no layers to slow)."""
    if not 0.0 <= seconds <= 60.0:
        raise ValueError(f"inject_layer_delay takes 0-60 s, not {seconds!r}")
    if core.model is None:
        raise ValueError("inject_layer_delay needs a model (not the simulator's stand-in)")
    core.model.progress = _SlowLayers(core.progress, seconds) if seconds else core.progress


def _inject_hang(core: EngineCore, kind: str) -> None:
    """Fault injection: the core's main thread never comes back, as a bug would hang it ("busy": a loop
    that spins; "deadlock": waiting on a lock nobody releases). Only the front end's hang watch ends it."""
    if kind == "busy":
        while True:
            pass
    if kind == "deadlock":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()
    raise ValueError(f"inject_hang takes 'busy' or 'deadlock', not {kind!r}")


UTILITIES: dict[str, Callable[..., Any]] = {
    "has_unfinished_requests": lambda core: core.has_unfinished_requests(),
    "num_unfinished_requests": lambda core: core.num_unfinished_requests,
    "num_steps": lambda core: core.num_steps,
    "stats": lambda core: core.stats(),
    "kv_usage": lambda core: core.kv_cache.usage,
    "holds_blocks": lambda core, request_id: core.kv_cache.holds_blocks(request_id),
    "idle": lambda core: (core.has_unfinished_requests(), core.kv_cache.usage),
    "kv_facts": _kv_facts,
    "ping": lambda core: True,
    # LoRA adapters (tokenloop.core.adapters); "unload_lora" ends requests, so CoreLoop runs it (_call).
    "list_loras": lambda core: core.list_loras(),
    "load_lora": lambda core, name, path: core.load_lora(name, path),
    "lora_in_flight": lambda core, name: len(core.lora_in_flight(name)),
    "inject_step_delay": _inject_step_delay,  # fault injection: every step sleeps first (tests, the soak)
    "inject_layer_delay": _inject_layer_delay,  # fault injection: a slow model, progress per layer
    "inject_hang": _inject_hang,  # fault injection: the main thread hangs for good (the hang watch's test)
    # Handoff (tokenloop.core.handoff): the EngineCore methods of the same names.
    "export_request": lambda core, request_id, skip_hashes=(), lease_s=30.0: core.export_request(
        request_id, skip_hashes, lease_s),
    "import_request": lambda core, snapshot: core.import_request(snapshot),
    "complete_export": lambda core, lease_id: core.complete_export(lease_id),
    "resume_export": lambda core, lease_id: core.resume_export(lease_id),
    "precopy_blocks": lambda core, request_id, skip_hashes=(), max_blocks=None: core.precopy_blocks(
        request_id, skip_hashes, max_blocks),
    "import_blocks": lambda core, blocks: core.import_blocks(blocks),
    "kv_snapshot": lambda core: core.kv_snapshot(),  # a router's mirror resyncs after a gap
    "kv_events_since": lambda core, seq: core.kv_events_since(seq),
}


@dataclass
class RecordBuffer:
    """An observer that keeps the core's records until the next frame carries them to the front end."""

    arrivals: list[ArrivalRecord] = field(default_factory=list)
    releases: list[ReleaseInfo] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)

    def on_arrival(self, record: ArrivalRecord) -> None:
        self.arrivals.append(record)

    def on_step(self, record: StepRecord) -> None:
        self.steps.append(record)

    def on_release(self, records: list[ReleaseInfo]) -> None:
        self.releases.extend(records)


@dataclass
class _Parked:
    """A submission waiting for its grammars to compile; aborts while it waits remove its requests."""

    message: AddRequests
    grammars: list[concurrent.futures.Future[Any]]

    @property
    def ready(self) -> bool:
        return all(g.done() for g in self.grammars)

    def error(self) -> BaseException | None:
        return next((g.exception() for g in self.grammars if g.exception() is not None), None)


class CoreLoop:
    """Applies input messages to an `EngineCore` and turns each step into one `CoreFrame`.

    With a `buffer` (registered as one of the core's observers) frames carry the records; without one the
    core's own observers got them already (the in-process mode).
    """

    def __init__(self, core: EngineCore, buffer: RecordBuffer | None = None) -> None:
        self.core = core
        self.buffer = buffer
        self.stopped = False
        self.last_num_scheduled = 0
        self._finals: list[CoreOutput] = []  # of requests finished by a message, for the next frame
        self._results: list[CallResult] = []
        self._parked: list[_Parked] = []  # submissions whose grammars are compiling, in arrival order
        self._dirty = False  # something changed since the last frame: send one even without a step

    def apply(self, message: InputMessage) -> None:
        """Apply one message; a failure becomes the caller's answer, never the loop's."""
        self._dirty = True
        core = self.core
        if isinstance(message, AddRequests):
            try:
                compiling = core.structured.compile_later([r.params.structured_outputs for r in message.requests])
            except Exception as exc:  # noqa: BLE001 - the submitter raises it again
                self._results.append(CallResult(message.call_id, None, error_to_wire(exc)))
                return
            if compiling:
                self._parked.append(_Parked(message, compiling))
            else:
                self._add(message)
        elif isinstance(message, FinishRequests):
            ended = set(message.request_ids)
            for parked in self._parked:  # never added: nothing to release, and they never will be
                parked.message.requests = [r for r in parked.message.requests if r.request_id not in ended]
            self._finals.extend(core.finish_requests(message.request_ids, message.finish_reason,
                                                     message.stop_reason))
        elif isinstance(message, UtilityCall):
            self._results.append(self._call(message))
        elif isinstance(message, Shutdown):
            for parked in self._parked:
                stopping = EngineStoppedError("the engine core is shutting down")
                self._results.append(CallResult(parked.message.call_id, None, error_to_wire(stopping)))
            self._parked.clear()
            core.structured.close()
            self._finals.extend(core.finish_requests(list(core._requests), FinishReason.ABORT))
            self.stopped = True
        else:
            raise TypeError(f"not an engine-core message: {type(message).__name__}")

    def _add(self, message: AddRequests) -> None:
        try:
            if message.requests:  # all of them may have been aborted while parked
                self.core.add_requests(message.requests)
            self._results.append(CallResult(message.call_id))
        except Exception as exc:  # noqa: BLE001 - the submitter raises it again
            self._results.append(CallResult(message.call_id, None, error_to_wire(exc)))

    def _admit_compiled(self) -> None:
        """Add (or refuse) every parked submission whose grammars are done compiling."""
        still: list[_Parked] = []
        for parked in self._parked:
            if not parked.ready:
                still.append(parked)
                continue
            self._dirty = True
            error = parked.error()
            if error is not None:
                self._results.append(CallResult(parked.message.call_id, None, error_to_wire(error)))
            else:
                self._add(parked.message)  # its grammars are in the cache now
        self._parked = still

    def _call(self, call: UtilityCall) -> CallResult:
        if call.name == "unload_lora":  # its adapter's unfinished requests end: finals go out next frame
            try:
                finals = self.core.unload_lora(*call.args)
            except Exception as exc:  # noqa: BLE001 - the caller raises it again
                return CallResult(call.call_id, None, error_to_wire(exc))
            self._finals.extend(finals)
            return CallResult(call.call_id, len(finals))
        fn = UTILITIES.get(call.name)
        try:
            if fn is None:
                raise KeyError(f"the engine core has no utility {call.name!r}")
            return CallResult(call.call_id, fn(self.core, *call.args))
        except Exception as exc:  # noqa: BLE001 - the caller raises it again
            return CallResult(call.call_id, None, error_to_wire(exc))

    @property
    def has_pending(self) -> bool:
        """Answers or finals wait for the next frame."""
        return self._dirty or bool(self._results) or bool(self._finals)

    @property
    def has_work(self) -> bool:
        """Requests to step, or submissions waiting for their grammars (the loop polls for those)."""
        return (self.core.has_unfinished_requests() or bool(self._parked)) and not self.stopped

    def turn(self) -> CoreFrame | None:
        """Step if there is work; the frame to send, or None when nothing happened at all."""
        core = self.core
        outputs: CoreOutputs | None = None
        if self._parked:
            self._admit_compiled()
        if core.has_unfinished_requests() and not self.stopped:
            outputs = core.step()
            self.last_num_scheduled = outputs.num_scheduled
            if self._finals:
                outputs.outputs[:0] = self._finals
        else:
            self.last_num_scheduled = 0  # only parked submissions: the loop polls, it does not spin
            if self._finals or self._dirty:
                outputs = CoreOutputs(self._finals, core.clock(), 0)
        if outputs is None and not self._results:
            return None
        buffer = self.buffer
        if buffer is not None and outputs is not None:
            # step() put its own record on its outputs; the rest came between steps.
            outputs.arrivals, outputs.releases = buffer.arrivals, buffer.releases
            buffer.arrivals, buffer.releases, buffer.steps = [], [], []
        frame = CoreFrame(outputs, self._results)
        self._finals, self._results, self._dirty = [], [], False
        return frame
