"""AsyncEngine: the serving loop on its own thread, with one async stream of outputs per request.

The `LLMEngine` is not thread-safe, so exactly one thread (the engine thread) ever touches it. The event
loop talks to that thread through a command list guarded by a condition variable: submissions, aborts
and arbitrary calls are applied between steps, in the order they were sent. Outputs travel back with
`loop.call_soon_threadsafe` into an `asyncio.Queue` per stream, one callback per step and loop. When
there is no work and no command, the thread sleeps on the condition instead of spinning.

    async_engine = AsyncEngine(engine, metrics)
    stream = await async_engine.add_requests([RequestSpec("r1", "Hello", SamplingParams(max_tokens=8))])
    async for output in stream:  # RequestOutput deltas; the last one has finished=True
        ...

Leaving the `async for` early (a client that went away) must be followed by `stream.abort()`; the
`generate` helper does that in a `finally`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tokenloop.engine import CompletionOutput, LLMEngine, RequestOutput
from tokenloop.errors import EngineStoppedError, RequestFailedError
from tokenloop.observe.metrics import EngineMetrics
from tokenloop.request import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How long the engine thread sleeps when requests exist but none could be scheduled (avoids a busy loop).
_NOTHING_SCHEDULED_WAIT_S = 0.005
_GIL_SWITCH_INTERVAL_S = 0.0005


@dataclass
class RequestSpec:
    """One request to submit: what `LLMEngine.add_request` takes."""

    request_id: str
    prompt: str | Sequence[int] | None
    params: SamplingParams
    prompt_token_ids: Sequence[int] | None = None
    priority: int = 0
    user: str | None = None
    cache_salt: str | None = None


@dataclass
class EngineCounts:
    """Lifetime request counts kept by the engine thread (for health checks and the soak test)."""

    accepted: int = 0
    rejected: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    step_failures: int = 0

    @property
    def num_finished(self) -> int:
        return sum(self.finished.values())


class RequestStream:
    """The async stream of `RequestOutput`s of one submission (one or more engine requests).

    Iteration ends after every request of the submission delivered its finished output. A request that
    failed without an output (its step raised) raises `RequestFailedError` from the iterator.
    """

    def __init__(self, engine: AsyncEngine, request_ids: Sequence[str], loop: asyncio.AbstractEventLoop,
                 max_backlog: int | None = None) -> None:
        self.request_ids = list(request_ids)
        self.loop = loop
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._unfinished = set(request_ids)
        self._max_backlog = max_backlog
        self._overflowed = False

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Queue an output (on the stream's loop, via call_soon_threadsafe); a reader that fell too far
        behind has its requests aborted instead of having their outputs buffered without bound."""
        if self._overflowed:
            return
        if self._max_backlog is not None and self._queue.qsize() >= self._max_backlog:
            self._overflowed = True
            self._engine.abort([rid for rid in self.request_ids if rid in self._unfinished])
            while not self._queue.empty():
                self._queue.get_nowait()
            item = RequestFailedError(f"the client stopped reading: more than {self._max_backlog} outputs "
                                      "were waiting for it, so its request was aborted")
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def abort(self) -> None:
        """Cancel whatever of this submission is still running (idempotent, returns at once)."""
        if self._unfinished:
            self._engine.abort(list(self._unfinished))
            self._unfinished.clear()


# ---- commands from the event loop to the engine thread ------------------------------------------------

@dataclass
class _Submit:
    specs: list[RequestSpec]
    stream: RequestStream
    done: concurrent.futures.Future[None]


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future[Any]


@dataclass
class _Stop:
    pass


@dataclass
class _Live:
    """Engine-thread state of one accepted request."""

    spec: RequestSpec
    stream: RequestStream
    first_output_seen: bool = False


class AsyncEngine:
    """Runs an `LLMEngine` on a dedicated thread; coroutines submit, stream and abort requests."""

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None, *, name: str = "tokenloop-engine",
                 max_stream_backlog: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._name = name
        self._max_stream_backlog = max_stream_backlog
        self.crashed = False  # the engine thread died of a bug: the process should exit non-zero
        self._wakeup = threading.Condition()
        self._commands: list[_Submit | _Abort | _Call | _Stop] = []  # guarded by _wakeup
        self._closed = False  # guarded by _wakeup: set once the engine thread has exited
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._accepting = True
        self._stopped = threading.Event()
        self._live: dict[str, _Live] = {}  # owned by the engine thread; others only read its length
        self._counts = EngineCounts()
        self._counts_lock = threading.Lock()
        self.num_wakeups = 0  # engine-thread loop iterations: stays put while idle (no spinning)

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._start_lock:
            if self._thread is not None:
                return
            if self._stopped.is_set():
                raise EngineStoppedError("the engine has been shut down")
            # The engine thread releases the GIL in every torch op and must get it back at once: with the
            # default 5 ms switch interval, any thread doing Python work (an export, a chat template) makes it
            # wait up to 5 ms per op, slowing steps many times over. 0.5 ms bounds that convoy.
            if sys.getswitchinterval() > _GIL_SWITCH_INTERVAL_S:
                sys.setswitchinterval(_GIL_SWITCH_INTERVAL_S)
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting and not self._stopped.is_set()

    @property
    def num_live_requests(self) -> int:
        """Accepted requests that have not ended yet (a racy read, good enough for polling)."""
        return len(self._live)

    def counts(self) -> EngineCounts:
        """A copy of the lifetime request counts."""
        with self._counts_lock:
            c = self._counts
            return EngineCounts(c.accepted, c.rejected, dict(c.finished), c.step_failures)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, let in-flight requests finish for up to `timeout_s`, abort the rest, join.

        Idempotent: the server starts it when shutdown begins, the app's lifespan calls it again at the end.
        """
        if self._stopped.is_set():
            return
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self.is_running and self._live and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._live:
            logger.warning("shutdown: aborting %d unfinished request(s)", len(self._live))
        self._send(_Stop())
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, max(1.0, deadline - time.monotonic() + 1.0))
        self._stopped.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Synchronous `shutdown` without the grace period: abort everything, join the thread."""
        self._accepting = False
        self._send(_Stop())
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._stopped.set()

    # ---- the event loop's side ---------------------------------------------------------------------

    async def add_requests(self, specs: Sequence[RequestSpec]) -> RequestStream:
        """Submit requests as one unit (all accepted or none); returns their stream.

        Raises what `LLMEngine.add_request` raises (InvalidRequestError, CapacityError, ...) in the caller,
        or EngineStoppedError once shutdown began.
        """
        if not self.accepting:
            raise EngineStoppedError("the server is shutting down")
        if not specs:
            raise ValueError("add_requests needs at least one request")
        self.start()
        stream = RequestStream(self, [s.request_id for s in specs], asyncio.get_running_loop(),
                               self._max_stream_backlog)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._send(_Submit(list(specs), stream, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # Cancelled before admission: if the engine thread already took it, the abort undoes it.
            self.abort(stream.request_ids)
            raise
        return stream

    async def generate(self, request_id: str, prompt: str | Sequence[int] | None, params: SamplingParams,
                       **options: Any) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its outputs; aborts it if the consumer stops early.

        Wrap it in `contextlib.aclosing` when you may leave the loop early: an async generator left by
        `break` is only closed (and the request aborted) when it is garbage-collected.
        """
        stream = await self.add_requests([RequestSpec(request_id, prompt, params, **options)])
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests (thread-safe, idempotent); applied before the engine's next step."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if ids:
            self._send(_Abort(ids))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        if self._stopped.is_set():
            return fn(self.engine)  # no thread left to race with
        self.start()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._send(_Call(fn, done))
        return await asyncio.wrap_future(done)

    def call_blocking(self, fn: Callable[[LLMEngine], T], timeout_s: float = 30.0) -> T:
        """`call` for synchronous code on another thread (tests, tools); never from the event loop."""
        if self._stopped.is_set():
            return fn(self.engine)
        self.start()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._send(_Call(fn, done))
        return done.result(timeout_s)

    def _send(self, command: _Submit | _Abort | _Call | _Stop) -> None:
        with self._wakeup:
            if self._closed:  # the engine thread is gone: nobody would ever answer
                if isinstance(command, (_Submit, _Call)) and command.done.set_running_or_notify_cancel():
                    command.done.set_exception(EngineStoppedError("the engine has stopped"))
                return
            self._commands.append(command)
            self._wakeup.notify()

    # ---- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        busy = False
        try:
            while True:
                with self._wakeup:
                    while not self._commands and not busy:
                        self._wakeup.wait()
                    commands, self._commands = self._commands, []
                self.num_wakeups += 1
                stop_at = next((i for i, command in enumerate(commands) if self._apply(command)), None)
                if stop_at is not None:
                    with self._wakeup:  # whatever came after the stop is refused by the drain below
                        self._commands[:0] = commands[stop_at + 1:]
                    break
                busy = engine.has_unfinished_requests()
                if busy:
                    self._step()
                    busy = engine.has_unfinished_requests()
                    if busy and engine.last_num_scheduled == 0:
                        with self._wakeup:  # nothing fit this step: wait a little for a change
                            if not self._commands:
                                self._wakeup.wait(_NOTHING_SCHEDULED_WAIT_S)
        except BaseException:  # a bug in this loop itself: fail everyone rather than hang them
            logger.critical("the engine thread crashed; failing %d in-flight request(s)", len(self._live),
                            exc_info=True)
            self._accepting = False
            self.crashed = True
            self._fail_all(RequestFailedError("the engine stopped unexpectedly; the server is restarting"))
            raise
        finally:
            self._stopped.set()
            self._drain_after_stop()

    def _apply(self, command: _Submit | _Abort | _Call | _Stop) -> bool:
        """Apply one command; True means stop the loop."""
        if isinstance(command, _Submit):
            self._submit(command)
        elif isinstance(command, _Abort):
            self._abort(command.request_ids, notify=False)
        elif isinstance(command, _Call):
            if command.done.set_running_or_notify_cancel():
                try:
                    command.done.set_result(command.fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    command.done.set_exception(exc)
        elif isinstance(command, _Stop):
            self._abort(list(self._live), notify=True)
            return True
        return False

    def _submit(self, command: _Submit) -> None:
        if not command.done.set_running_or_notify_cancel():
            return  # the submitter went away before we got to it
        added: list[str] = []
        try:
            for spec in command.specs:
                self.engine.add_request(spec.request_id, spec.prompt, spec.params,
                                        prompt_token_ids=spec.prompt_token_ids, priority=spec.priority,
                                        user=spec.user, cache_salt=spec.cache_salt)
                added.append(spec.request_id)
        except BaseException as exc:  # noqa: BLE001 - handed to the submitter
            if added:
                self.engine.abort_request(added)  # all or none
            with self._counts_lock:
                self._counts.rejected += 1
            command.done.set_exception(exc)
            return
        for spec in command.specs:
            self._live[spec.request_id] = _Live(spec, command.stream)
        with self._counts_lock:
            self._counts.accepted += len(command.specs)
        command.done.set_result(None)

    def _abort(self, request_ids: list[str], *, notify: bool) -> None:
        """Abort live requests; with `notify`, their streams get a final 'abort' output."""
        ids = [rid for rid in request_ids if rid in self._live]
        if not ids:
            return
        self.engine.abort_request(ids)
        deliveries: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        for rid in ids:
            live = self._live.pop(rid)
            self._count_finished("abort")
            if self.metrics is not None:
                self.metrics.observe_aborted()
            if notify:
                deliveries.append((live.stream, _aborted_output(live.spec)))
        self._deliver(deliveries)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # noqa: BLE001 - not one request's fault (those fail alone inside the step)
            logger.exception("engine step failed; failing the %d in-flight request(s)", len(self._live))
            with self._counts_lock:
                self._counts.step_failures += 1
            # The text names no request's data: it reaches every client in flight.
            self._fail_all(RequestFailedError("the engine step failed; see the server log"))
            return
        deliveries: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        metrics = self.metrics
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:
                continue  # aborted meanwhile: nobody listens
            if not live.first_output_seen and any(c.token_ids_delta for c in output.outputs):
                live.first_output_seen = True
                if metrics is not None:
                    metrics.observe_first_output(len(output.prompt_token_ids))
            if output.finished:
                del self._live[output.request_id]
                reason = _request_finish_reason(output)
                self._count_finished(reason)
                if metrics is not None:
                    metrics.observe_finished(reason, output.metrics)
            deliveries.append((live.stream, output))
        self._deliver(deliveries)

    def _fail_all(self, error: BaseException) -> None:
        ids = list(self._live)
        if not ids:
            return
        try:
            self.engine.abort_request(ids)
        except Exception:  # noqa: BLE001 - the engine is already broken; the streams must still end
            logger.exception("aborting failed requests raised")
        deliveries: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        for rid in ids:
            live = self._live.pop(rid)
            self._count_finished("error")
            if self.metrics is not None:
                self.metrics.observe_finished("error", None)
            deliveries.append((live.stream, error))
        self._deliver(deliveries)

    def _count_finished(self, reason: str) -> None:
        with self._counts_lock:
            self._counts.finished[reason] = self._counts.finished.get(reason, 0) + 1

    def _deliver(self, deliveries: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        """Hand outputs to their loops: one callback per loop per step, not one per token."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput | BaseException]]] = {}
        for stream, item in deliveries:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_dispatch, items)
            except RuntimeError:  # that loop is closed: its requests have no reader left
                ids = [rid for stream, _ in items for rid in stream.request_ids if rid in self._live]
                if ids:
                    self.engine.abort_request(ids)
                    for rid in ids:
                        self._live.pop(rid, None)
                        self._count_finished("abort")

    def _drain_after_stop(self) -> None:
        """Refuse commands that arrived after the stop, so no submitter waits forever."""
        with self._wakeup:
            commands, self._commands = self._commands, []
            self._closed = True
        for command in commands:
            if isinstance(command, (_Submit, _Call)) and command.done.set_running_or_notify_cancel():
                command.done.set_exception(EngineStoppedError("the engine has stopped"))


def _dispatch(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream._put(item)  # noqa: SLF001 - the stream's own loop-side entry point


def _request_finish_reason(output: RequestOutput) -> str:
    reasons = [c.finish_reason for c in output.outputs if c.finish_reason is not None]
    if "error" in reasons:
        return "error"
    return reasons[0] if reasons else "abort"


def _aborted_output(spec: RequestSpec) -> RequestOutput:
    """The final output of a request the server aborted: no new tokens, finish_reason 'abort'."""
    outputs = [CompletionOutput(index=i, text="", token_ids=[], text_delta="", token_ids_delta=[], logprobs=None,
                                logprobs_delta=None, cumulative_logprob=None, finish_reason="abort")
               for i in range(spec.params.n)]
    prompt = spec.prompt if isinstance(spec.prompt, str) else None
    return RequestOutput(spec.request_id, prompt, list(spec.prompt_token_ids or []), None, outputs, finished=True)
