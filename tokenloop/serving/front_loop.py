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
import os
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
from tokenloop.outputs import RequestOutput
from tokenloop.serving.streams import (
    RequestSpec,
    RequestStream,
    aborted_output,
    dispatch,
    request_finish_reason,
)

if TYPE_CHECKING:
    from tokenloop.serving.async_engine import AsyncEngine, _Submit

logger = logging.getLogger(__name__)

Delivery = tuple[RequestStream, RequestOutput | BaseException]


class FrontLoop:
    """The body of `AsyncEngine`'s engine thread (it reads and writes that engine's thread-owned state)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.e = engine
        self.client = engine.client
        self.outputs = engine.outputs
        self._messages: list[InputMessage] = []  # for the core, sent once per turn

    def run(self) -> None:
        from tokenloop.serving import async_engine as ae

        e, client = self.e, self.client
        poller = zmq.Poller()
        poller.register(e._wake_read, zmq.POLLIN)
        registered = list(client.pollables())
        for pollable in registered:
            poller.register(pollable, zmq.POLLIN)
        try:
            while True:
                registered = _reregister(poller, registered, client.pollables())
                with e._lock:
                    idle = not e._commands
                if idle:
                    poller.poll(client.poll_timeout_ms())
                self._drain_wakeups()
                with e._lock:
                    commands, e._commands = e._commands, []
                e.num_wakeups += 1
                stop = False
                for index, command in enumerate(commands):
                    if isinstance(command, ae._Stop):
                        self._abort(list(e._live), notify=True)
                        with e._lock:
                            e._commands[:0] = commands[index + 1:]
                        stop = True
                        break
                    self._apply(command)
                self._flush()
                if stop:
                    break
                self._receive()
                why = client.death()
                if why is not None:
                    raise ae._CoreDied(why)
        except ae._CoreDied as died:
            logger.critical("%s; failing %d in-flight request(s)", died, len(e._live))
            self._die(str(died))
        except BaseException:  # a bug in this loop itself: fail everyone rather than hang them
            logger.critical("the engine thread crashed; failing %d in-flight request(s)", len(e._live),
                            exc_info=True)
            self._die("the engine stopped unexpectedly")
            raise
        finally:
            e._stopped.set()
            e._drain_after_stop()

    def _die(self, why: str) -> None:
        e = self.e
        e._accepting = False
        e.crashed, e.death = True, why
        self._fail_all(RequestFailedError(f"{why}; the server is restarting"), tell_core=False)

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self.e._wake_read, 4096):
                pass
        except BlockingIOError:
            pass

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
        e = self.e
        e._next_call_id += 1
        return e._next_call_id

    # ---- commands ----------------------------------------------------------------------------------

    def _apply(self, command: Any) -> None:
        from tokenloop.serving import async_engine as ae

        e = self.e
        if isinstance(command, ae._Submit):
            self._submit(command)
        elif isinstance(command, ae._Abort):
            self._abort(command.request_ids, notify=False)
        elif isinstance(command, ae._Call):
            if command.done.set_running_or_notify_cancel():
                self._flush()  # the call sees every message sent before it
                try:
                    command.done.set_result(command.fn(e.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    command.done.set_exception(exc)
        elif isinstance(command, ae._Utility) and command.done.set_running_or_notify_cancel():
            call_id = self._call_id()
            e._waiting[call_id] = command
            self._messages.append(UtilityCall(call_id, command.name, command.args))

    def _submit(self, command: _Submit) -> None:
        if not command.done.set_running_or_notify_cancel():
            return  # the submitter went away before we got to it
        e, outputs = self.e, self.outputs
        core_requests = []
        added: list[str] = []
        try:
            for spec in command.specs:
                core_requests.extend(self._prepare(spec))
                added.append(spec.request_id)
        except BaseException as exc:  # noqa: BLE001 - handed to the submitter
            for request_id in added:
                outputs.forget(request_id)  # all or none
            with e._counts_lock:
                e._counts.rejected += 1
            command.done.set_exception(exc)
            return
        for spec in command.specs:  # live now: the answer and the first outputs come in the same frame
            e._live[spec.request_id] = ae_live(spec, command.stream)
        call_id = self._call_id()
        e._waiting[call_id] = command
        self._messages.append(AddRequests(call_id, core_requests))

    def _prepare(self, spec: RequestSpec) -> list[Any]:
        """A request's front-end state (one detokenizer per sample); its core requests."""
        e = self.e
        if spec.prompt_token_ids is not None:
            ids = list(spec.prompt_token_ids)
        elif isinstance(spec.prompt, str):
            ids = e.tokenizer.encode(spec.prompt)
        elif spec.prompt is not None:
            ids = list(spec.prompt)
        else:
            raise InvalidRequestError("a prompt (text or token ids) is required", param="prompt")
        params = spec.params
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max(1, e.max_model_len - len(ids)))
        text = spec.prompt if isinstance(spec.prompt, str) else None
        return self.outputs.add(spec.request_id, text, ids, params, e.clock(), priority=spec.priority,
                                user=spec.user, cache_salt=spec.cache_salt, lora_name=spec.lora_name)

    def _answer(self, result: CallResult) -> None:
        from tokenloop.serving import async_engine as ae

        e = self.e
        waiting = e._waiting.pop(result.call_id, None)
        if waiting is None:
            return
        if isinstance(waiting, ae._Utility):
            if result.error is not None:
                waiting.done.set_exception(error_from_wire(result.error))
            else:
                waiting.done.set_result(result.value)
            return
        if result.error is not None:  # refused, all of it: the submitter raises the core's error
            for spec in waiting.specs:
                e._live.pop(spec.request_id, None)
                self.outputs.forget(spec.request_id)
            with e._counts_lock:
                e._counts.rejected += 1
            waiting.done.set_exception(error_from_wire(result.error))
            return
        with e._counts_lock:
            e._counts.accepted += len(waiting.specs)
        waiting.done.set_result(None)

    def _abort(self, request_ids: list[str], *, notify: bool) -> None:
        """Abort live requests; with `notify`, their streams get a final 'abort' output."""
        e = self.e
        ids = [rid for rid in request_ids if rid in e._live]
        if not ids:
            return
        core_ids = [cid for rid in ids for cid in self.outputs.core_ids(rid)]
        deliveries: list[Delivery] = []
        for rid in ids:
            self.outputs.forget(rid)  # the core's finals for them find nobody: nothing more is sent
            live = e._live.pop(rid)
            e._count_finished("abort")
            if e.metrics is not None:
                e.metrics.observe_aborted()
            if notify:
                deliveries.append((live.stream, aborted_output(live.spec)))
        if core_ids:
            self._messages.append(FinishRequests(core_ids, "abort"))
        self._deliver(deliveries)

    def _fail_all(self, error: BaseException, *, tell_core: bool = True) -> None:
        e = self.e
        ids = list(e._live)
        core_ids = [cid for rid in ids for cid in self.outputs.core_ids(rid)]
        deliveries: list[Delivery] = []
        for rid in ids:
            self.outputs.forget(rid)
            live = e._live.pop(rid)
            e._count_finished("error")
            if e.metrics is not None:
                e.metrics.observe_finished("error", None)
            deliveries.append((live.stream, error))
        if tell_core and core_ids:
            self._messages.append(FinishRequests(core_ids, "abort"))
            self._flush()
        self._deliver(deliveries)

    # ---- frames from the core ----------------------------------------------------------------------

    def _receive(self) -> None:
        e = self.e
        try:
            frames = self.client.receive()
        except Exception:
            if self.client.death() is not None:
                raise
            logger.exception("engine step failed; failing the %d in-flight request(s)", len(e._live))
            with e._counts_lock:
                e._counts.step_failures += 1
            # The text names no request's data: it reaches every client in flight.
            self._fail_all(RequestFailedError("the engine step failed; see the server log"))
            return
        for frame in frames:
            self._on_frame(frame)
        self._flush()  # stop-string finishes: the core stops computing them before its next step

    def _on_frame(self, frame: CoreFrame) -> None:
        e = self.e
        for result in frame.results:  # first: a request is live before its first output is delivered
            self._answer(result)
        core = frame.outputs
        if core is None:
            return
        observers = e.observers
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
            self._messages.append(FinishRequests([core_id], "stop", stop))
        if processed.failed:
            self._messages.append(FinishRequests(processed.failed, "error"))
        deliveries: list[Delivery] = []
        metrics = e.metrics
        for output in processed.outputs:
            live = e._live.get(output.request_id)
            if live is None:
                continue  # aborted meanwhile: nobody listens
            if not live.first_output_seen and any(c.token_ids_delta for c in output.outputs):
                live.first_output_seen = True
                if metrics is not None:
                    metrics.observe_first_output(len(output.prompt_token_ids))
            if output.finished:
                del e._live[output.request_id]
                reason = request_finish_reason(output)
                e._count_finished(reason)
                if metrics is not None:
                    metrics.observe_finished(reason, output.metrics, live.spec.lora_name)
            deliveries.append((live.stream, output))
        self._deliver(deliveries)

    def _deliver(self, deliveries: list[Delivery]) -> None:
        """Hand outputs to their loops: one callback per loop per step, not one per token."""
        e = self.e
        by_loop: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}
        for stream, item in deliveries:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(dispatch, items)
            except RuntimeError:  # that loop is closed: its requests have no reader left
                ids = [rid for stream, _ in items for rid in stream.request_ids if rid in e._live]
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


def ae_live(spec: RequestSpec, stream: RequestStream) -> Any:
    from tokenloop.serving.async_engine import _Live

    return _Live(spec, stream)
