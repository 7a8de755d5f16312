"""The engine thread's loop: commands in, core frames out, outputs to the streams.

One turn: wait (one poll on the wakeup pipe, the core's socket and the core process's sentinel) -> turn the
commands into core messages (a submission is detokenizer state here and an `AddRequests` there) -> send
them -> take every frame the core produced -> `OutputProcessor.process` each -> stop-string finishes go
back to the core at once -> records to the front end's observers -> outputs to their streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from tokenloop.core.messages import (
    AddRequests,
    CallResult,
    CoreFrame,
    FinishRequests,
    InputMessage,
    UtilityCall,
)
from tokenloop.core.wire import UnsendableMessages, error_from_wire, error_to_wire
from tokenloop.errors import InvalidRequestError, RequestFailedError
from tokenloop.outputs import OutputProcessor, RequestOutput
from tokenloop.request import FinishReason
from tokenloop.serving.core_client import CoreClient
from tokenloop.serving.front_commands import Abort, Call, CommandQueue, Stop, Submit, Utility, refuse
from tokenloop.serving.streams import (
    EngineCounts,
    RequestSpec,
    RequestStream,
    aborted_output,
    dispatch,
    request_finish_reason,
)

if TYPE_CHECKING:
    from tokenloop.engine import LLMEngine
    from tokenloop.observe.metrics import EngineMetrics
    from tokenloop.observe.records import ObserverSet
    from tokenloop.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Delivery = tuple[RequestStream, RequestOutput | BaseException]


@dataclass
class LiveRequest:
    """Engine-thread state of one accepted request."""

    spec: RequestSpec
    stream: RequestStream
    first_output_seen: bool = False


class CoreDied(Exception):
    """The engine core is gone (dead, or hung and killed): the loop fails everyone and ends."""


class FrontLoop:
    """The body of `AsyncEngine`'s engine thread and the state only that thread writes: the live requests,
    the calls waiting for the core's answer, the lifetime counts, and whether (and why) the core died."""

    def __init__(self, client: CoreClient, outputs: OutputProcessor, commands: CommandQueue, *,
                 engine: LLMEngine | None, tokenizer: Tokenizer, clock: Callable[[], int],
                 metrics: EngineMetrics | None, observers: ObserverSet) -> None:
        self.client, self.outputs, self.commands = client, outputs, commands
        self.engine, self.tokenizer, self.clock = engine, tokenizer, clock
        self.metrics, self.observers = metrics, observers
        self.max_model_len = client.info.max_model_len
        self.live: dict[str, LiveRequest] = {}  # others only read its length
        self.crashed = False  # the engine thread or the core died: the process should exit non-zero
        self.death: str | None = None  # why, when the core died
        self.num_wakeups = 0  # loop iterations: stays put while idle (no spinning)
        self._waiting: dict[int, Submit | Utility] = {}  # calls sent to the core, by call id
        self._next_call_id = 0
        self._counts = EngineCounts()
        self._counts_lock = threading.Lock()
        self._messages: list[InputMessage] = []  # for the core, sent once per turn

    def counts(self) -> EngineCounts:
        """A copy of the lifetime request counts (any thread)."""
        with self._counts_lock:
            c = self._counts
            return EngineCounts(c.accepted, c.rejected, dict(c.finished), c.step_failures)

    def run(self) -> None:
        """Turns until a Stop command or the core's death; the caller then calls `refuse_the_rest`."""
        client, commands = self.client, self.commands
        poller = zmq.Poller()
        poller.register(commands.wake_fd, zmq.POLLIN)
        registered = list(client.pollables())
        for pollable in registered:
            poller.register(pollable, zmq.POLLIN)
        try:
            while True:
                registered = _reregister(poller, registered, client.pollables())
                if commands.is_empty():
                    poller.poll(client.poll_timeout_ms())
                commands.drain_wakeups()
                taken = commands.take()
                self.num_wakeups += 1
                stop = False
                for index, command in enumerate(taken):
                    if isinstance(command, Stop):
                        self._abort(list(self.live), notify=True)
                        commands.put_back(taken[index + 1:])
                        stop = True
                        break
                    self._apply(command)
                self._flush()
                if stop:
                    break
                self._receive()
                why = client.death()
                if why is not None:
                    raise CoreDied(why)
        except CoreDied as died:
            logger.critical("%s; failing %d in-flight request(s)", died, len(self.live))
            self._die(str(died))
        except BaseException:  # a bug in this loop itself: fail everyone rather than hang them
            logger.critical("the engine thread crashed; failing %d in-flight request(s)", len(self.live),
                            exc_info=True)
            self._die("the engine stopped unexpectedly")
            raise

    def refuse_the_rest(self) -> None:
        """Refuse commands that arrived after the stop, and calls the core never answered (it died or
        hung first: the reason says so), so no submitter waits forever."""
        why = f"{self.death}; the server is restarting" if self.death else "the engine has stopped"
        for command in [*self.commands.close(), *self._waiting.values()]:
            refuse(command, why)
        self._waiting.clear()

    def _die(self, why: str) -> None:
        self.crashed, self.death = True, why
        self._fail_all(RequestFailedError(f"{why}; the server is restarting"), tell_core=False)

    def _count_finished(self, reason: str) -> None:
        with self._counts_lock:
            self._counts.finished[reason] = self._counts.finished.get(reason, 0) + 1

    def _flush(self) -> None:
        if self._messages:
            messages, self._messages = self._messages, []
            try:
                self.client.send(messages)
            except UnsendableMessages as unsendable:  # the others went: only these submitters hear of it
                for message, cause in unsendable.failures:
                    self._refuse_unsendable(message, cause)

    def _refuse_unsendable(self, message: InputMessage, cause: BaseException) -> None:
        call_id = getattr(message, "call_id", None)
        if call_id is None:
            logger.error("a %s could not be sent to the engine core: %r", type(message).__name__, cause)
            return
        why = f"a value in this request cannot be sent to the engine core ({type(cause).__name__}: {cause})"
        self._answer(CallResult(call_id, None, error_to_wire(InvalidRequestError(why))))

    def _call_id(self) -> int:
        self._next_call_id += 1
        return self._next_call_id

    # ---- commands ----------------------------------------------------------------------------------

    def _apply(self, command: Submit | Abort | Call | Utility) -> None:
        if isinstance(command, Submit):
            self._submit(command)
        elif isinstance(command, Abort):
            self._abort(command.request_ids, notify=False)
        elif isinstance(command, Call):
            if command.done.set_running_or_notify_cancel():
                self._flush()  # the call sees every message sent before it
                try:
                    command.done.set_result(command.fn(self.engine))  # type: ignore[arg-type] - checked on send
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    command.done.set_exception(exc)
        elif isinstance(command, Utility) and command.done.set_running_or_notify_cancel():
            call_id = self._call_id()
            self._waiting[call_id] = command
            self._messages.append(UtilityCall(call_id, command.name, command.args))

    def _submit(self, command: Submit) -> None:
        if not command.done.set_running_or_notify_cancel():
            return  # the submitter went away before we got to it
        outputs = self.outputs
        core_requests = []
        added: list[str] = []
        try:
            for spec in command.specs:
                core_requests.extend(self._prepare(spec))
                added.append(spec.request_id)
        except BaseException as exc:  # noqa: BLE001 - handed to the submitter
            for request_id in added:
                outputs.forget(request_id)  # all or none
            with self._counts_lock:
                self._counts.rejected += 1
            command.done.set_exception(exc)
            return
        for spec in command.specs:  # live now: the answer and the first outputs come in the same frame
            self.live[spec.request_id] = LiveRequest(spec, command.stream)
        call_id = self._call_id()
        self._waiting[call_id] = command
        self._messages.append(AddRequests(call_id, core_requests))

    def _prepare(self, spec: RequestSpec) -> list[Any]:
        """A request's front-end state (one detokenizer per sample); its core requests."""
        if spec.prompt_token_ids is not None:
            ids = list(spec.prompt_token_ids)
        elif isinstance(spec.prompt, str):
            ids = self.tokenizer.encode(spec.prompt)
        elif spec.prompt is not None:
            ids = list(spec.prompt)
        else:
            raise InvalidRequestError("a prompt (text or token ids) is required", param="prompt")
        params = spec.params
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max(1, self.max_model_len - len(ids)))
        text = spec.prompt if isinstance(spec.prompt, str) else None
        return self.outputs.add(spec.request_id, text, ids, params, self.clock(), priority=spec.priority,
                                user=spec.user, cache_salt=spec.cache_salt, lora_name=spec.lora_name)

    def _answer(self, result: CallResult) -> None:
        waiting = self._waiting.pop(result.call_id, None)
        if waiting is None:
            return
        if isinstance(waiting, Utility):
            if result.error is not None:
                waiting.done.set_exception(error_from_wire(result.error))
            else:
                waiting.done.set_result(result.value)
            return
        if result.error is not None:  # refused, all of it: the submitter raises the core's error
            for spec in waiting.specs:
                self.live.pop(spec.request_id, None)
                self.outputs.forget(spec.request_id)
            with self._counts_lock:
                self._counts.rejected += 1
            waiting.done.set_exception(error_from_wire(result.error))
            return
        with self._counts_lock:
            self._counts.accepted += len(waiting.specs)
        waiting.done.set_result(None)

    def _abort(self, request_ids: list[str], *, notify: bool) -> None:
        """Abort live requests; with `notify`, their streams get a final 'abort' output."""
        ids = [rid for rid in request_ids if rid in self.live]
        if not ids:
            return
        core_ids = [cid for rid in ids for cid in self.outputs.core_ids(rid)]
        deliveries: list[Delivery] = []
        for rid in ids:
            self.outputs.forget(rid)  # the core's finals for them find nobody: nothing more is sent
            live = self.live.pop(rid)
            self._count_finished(FinishReason.ABORT)
            if self.metrics is not None:
                self.metrics.observe_aborted(live.spec.lora_name)
            if notify:
                deliveries.append((live.stream, aborted_output(live.spec)))
        if core_ids:
            self._messages.append(FinishRequests(core_ids, FinishReason.ABORT))
        self._deliver(deliveries)

    def _fail_all(self, error: BaseException, *, tell_core: bool = True) -> None:
        ids = list(self.live)
        core_ids = [cid for rid in ids for cid in self.outputs.core_ids(rid)]
        deliveries: list[Delivery] = []
        for rid in ids:
            self.outputs.forget(rid)
            live = self.live.pop(rid)
            self._count_finished(FinishReason.ERROR)
            if self.metrics is not None:
                self.metrics.observe_finished(FinishReason.ERROR, None)
            deliveries.append((live.stream, error))
        if tell_core and core_ids:
            self._messages.append(FinishRequests(core_ids, FinishReason.ABORT))
            self._flush()
        self._deliver(deliveries)

    # ---- frames from the core ----------------------------------------------------------------------

    def _receive(self) -> None:
        try:
            frames = self.client.receive()
        except Exception:
            if self.client.death() is not None:
                raise
            logger.exception("engine step failed; failing the %d in-flight request(s)", len(self.live))
            with self._counts_lock:
                self._counts.step_failures += 1
            # The text names no request's data: it reaches every client in flight.
            self._fail_all(RequestFailedError("the engine step failed; see the server log"))
            return
        for frame in frames:
            self._on_frame(frame)
        self._flush()  # stop-string finishes: the core stops computing them before its next step

    def _on_frame(self, frame: CoreFrame) -> None:
        for result in frame.results:  # first: a request is live before its first output is delivered
            self._answer(result)
        core = frame.outputs
        if core is None:
            return
        observers = self.observers
        if observers:
            for arrival in core.arrivals:
                observers.arrival(arrival)
            observers.release(core.releases)
            if core.record is not None:
                observers.step(core.record)
            for handoff in core.handoffs:
                observers.handoff(handoff)
        processed = self.outputs.process(core)
        for core_id, stop in processed.stopped:
            self._messages.append(FinishRequests([core_id], FinishReason.STOP, stop))
        if processed.failed:
            self._messages.append(FinishRequests(processed.failed, FinishReason.ERROR))
        deliveries: list[Delivery] = []
        metrics = self.metrics
        for output in processed.outputs:
            live = self.live.get(output.request_id)
            if live is None:
                continue  # aborted meanwhile: nobody listens
            if not live.first_output_seen and any(c.token_ids_delta for c in output.outputs):
                live.first_output_seen = True
                if metrics is not None:
                    metrics.observe_first_output(len(output.prompt_token_ids))
            if output.finished:
                del self.live[output.request_id]
                reason = request_finish_reason(output)
                self._count_finished(reason)
                if metrics is not None:
                    metrics.observe_finished(reason, output.metrics, live.spec.lora_name)
            deliveries.append((live.stream, output))
        self._deliver(deliveries)

    def _deliver(self, deliveries: list[Delivery]) -> None:
        """Hand outputs to their loops: one callback per loop per step, not one per token."""
        by_loop: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}
        for stream, item in deliveries:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(dispatch, items)
            except RuntimeError:  # that loop is closed: its requests have no reader left
                ids = [rid for stream, _ in items for rid in stream.request_ids if rid in self.live]
                self._abort(ids, notify=False)


def _reregister(poller: zmq.Poller, registered: list[Any], now: list[Any]) -> list[Any]:
    """Follow a client whose sockets change (a replica set restarting a dead replica)."""
    if now == registered:
        return registered
    for pollable in registered:
        if pollable not in now:
            try:
                poller.unregister(pollable)
            except (KeyError, ValueError, zmq.ZMQError):  # a closed socket of a dead replica
                pass
    for pollable in now:
        if pollable not in registered:
            poller.register(pollable, zmq.POLLIN)
    return list(now)
