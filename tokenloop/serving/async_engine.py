"""AsyncEngine: the front end's loop on its own thread, with one async stream of outputs per request.

The engine thread owns the front end's update stage (`OutputProcessor`: detokenizing, stop strings) and a
client of the engine core: the core in its own process over ZMQ (the server's default), or in this
process (tests, tools), where a turn of the thread's loop runs one core step. The event loop talks to the
thread through a command list and a wakeup pipe; the thread sleeps in one poll on that pipe, the core's
output socket and the core process's sentinel, so a submission wakes it at once and a dead core is seen
the moment it exits; a hung one once its heartbeat has shown no progress for the bound (`core.heartbeat`).

    async_engine = AsyncEngine(engine, metrics)                       # in-process core
    async_engine = AsyncEngine.with_core_process(config, metrics)     # the core in its own process
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
from typing import TYPE_CHECKING, Any, TypeVar

from tokenloop.core.heartbeat import DEFAULT_HANG_TIMEOUT_S
from tokenloop.errors import EngineStoppedError
from tokenloop.observe.metrics import EngineMetrics
from tokenloop.observe.records import ObserverSet, Observes
from tokenloop.outputs import OutputProcessor, RequestOutput
from tokenloop.request import SamplingParams, default_clock
from tokenloop.serving.core_client import (
    CoreClient,
    CoreProcessClient,
    InProcessCoreClient,
)
from tokenloop.serving.front_commands import Abort, Call, Command, CommandQueue, Stop, Submit, Utility
from tokenloop.serving.front_loop import FrontLoop
from tokenloop.serving.streams import EngineCounts, RequestSpec, RequestStream

if TYPE_CHECKING:
    from tokenloop.config import EngineConfig
    from tokenloop.engine import LLMEngine
    from tokenloop.model.loader import Checkpoint

__all__ = ["AsyncEngine", "EngineCounts", "RequestSpec", "RequestStream"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_GIL_SWITCH_INTERVAL_S = 0.0005


class AsyncEngine:
    """Runs the front end's loop on a dedicated thread; coroutines submit, stream and abort requests."""

    def __init__(self, engine: LLMEngine | None, metrics: EngineMetrics | None = None, *,
                 name: str = "tokenloop-engine", max_stream_backlog: int | None = None,
                 client: CoreClient | None = None, config: EngineConfig | None = None,
                 tokenizer: Any = None, tracer: Observes | None = None,
                 observers: Sequence[Observes] = ()) -> None:
        self.engine = engine  # None when the core runs in its own process
        self.metrics = metrics
        if engine is not None:  # the in-process core: its observers (the tracer) see its records directly
            self.client: CoreClient = InProcessCoreClient(engine.core)
            self.outputs = engine.outputs
            self.config, self.tokenizer, self.tracer = engine.config, engine.tokenizer, engine.tracer
            self.observers = ObserverSet()  # nothing travels in frames here: the core tells its observers
            for observer in [*observers, *([metrics] if metrics is not None else [])]:
                if observer not in engine.core.observers.observers:
                    engine.add_observer(observer)
        else:
            if client is None or config is None or tokenizer is None:
                raise ValueError("AsyncEngine needs an engine, or a core client with its config and "
                                 "tokenizer")
            self.client, self.config, self.tokenizer, self.tracer = client, config, tokenizer, tracer
            self.outputs = OutputProcessor(tokenizer)
            # Records made in the core process are dispatched here, to observers living in this one.
            self.observers = ObserverSet([*observers, *(o for o in (metrics, tracer) if o is not None)])
        info = self.client.info
        self.max_model_len, self.vocab_size = info.max_model_len, info.vocab_size
        self.block_size = info.block_size
        self.clock = default_clock
        self._name = name
        self._max_stream_backlog = max_stream_backlog
        self._commands = CommandQueue()
        # The engine thread's loop owns what only that thread writes (live requests, counts, the death).
        self._loop = FrontLoop(self.client, self.outputs, self._commands, engine=engine, tokenizer=self.tokenizer,
                               clock=lambda: self.clock(), metrics=metrics, observers=self.observers)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._accepting = True
        self._stopped = threading.Event()

    @classmethod
    def with_core_process(cls, config: EngineConfig, metrics: EngineMetrics | None = None, *,
                          checkpoint: Checkpoint | None = None, tracer: Observes | None = None,
                          observers: Sequence[Observes] = (), startup_timeout_s: float = 300.0,
                          client: CoreProcessClient | None = None,
                          hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S, **options: Any) -> AsyncEngine:
        """Start the engine core in its own process (or take `client`, one already started for `config`)
        and return once it is ready; this process loads only the tokenizer and config (or uses
        `checkpoint`'s, which the core then gets pickled), while the core loads the model. A core that
        makes no progress for `hang_timeout_s` is killed and handled as a dead one (0: never)."""
        from tokenloop.model.loader import load_model_info

        if client is None:
            client = CoreProcessClient(config, checkpoint, startup_timeout_s=startup_timeout_s, wait=False,
                                       hang_timeout_s=hang_timeout_s)
        try:
            tokenizer = (checkpoint.tokenizer if checkpoint is not None
                         else load_model_info(config.model).tokenizer)
            _ = client.info  # the core is ready
        except BaseException:
            client.close(timeout_s=1.0)
            raise
        if tracer is not None and hasattr(tracer, "bind"):
            tracer.bind(tokenizer, client.info.block_size, default_clock)
        return cls(None, metrics, client=client, config=config, tokenizer=tokenizer, tracer=tracer,
                   observers=observers, **options)

    @classmethod
    def with_replicas(cls, config: EngineConfig, cluster: Any, metrics: EngineMetrics | None = None, *,
                      checkpoint: Checkpoint | None = None, tracer: Observes | None = None,
                      observers: Sequence[Observes] = (), startup_timeout_s: float = 300.0,
                      **options: Any) -> AsyncEngine:
        """N engine cores behind a router (`cluster`: a `tokenloop.cluster.launch.ClusterOptions`); returns
        once every replica is ready. This process holds the tokenizer, the router and the records."""
        from tokenloop.cluster.launch import start_replica_set
        from tokenloop.model.loader import load_model_info

        tokenizer = (checkpoint.tokenizer if checkpoint is not None
                     else load_model_info(config.model).tokenizer)
        client = start_replica_set(config, cluster, checkpoint=checkpoint, startup_timeout_s=startup_timeout_s)
        if tracer is not None and hasattr(tracer, "bind"):
            tracer.bind(tokenizer, client.info.block_size, default_clock)
        return cls(None, metrics, client=client, config=config, tokenizer=tokenizer, tracer=tracer,
                   observers=observers, **options)

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
        return self._accepting and not self._loop.crashed and not self._stopped.is_set()

    @property
    def crashed(self) -> bool:
        """The engine thread or the core died: the process should exit non-zero."""
        return self._loop.crashed

    @property
    def death(self) -> str | None:
        """Why the core died, when it did."""
        return self._loop.death

    @property
    def num_wakeups(self) -> int:
        """Engine-thread loop iterations: stays put while idle (no spinning)."""
        return self._loop.num_wakeups

    @property
    def num_live_requests(self) -> int:
        """Accepted requests that have not ended yet (a racy read, good enough for polling)."""
        return len(self._loop.live)

    def counts(self) -> EngineCounts:
        """A copy of the lifetime request counts."""
        return self._loop.counts()

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, let in-flight requests finish for up to `timeout_s`, abort the rest, join.

        Idempotent: the server starts it when shutdown begins, the app's lifespan calls it again at the end.
        """
        if self._stopped.is_set():
            self.client.close()
            return
        self._accepting = False
        deadline = time.monotonic() + timeout_s
        while self.is_running and self._loop.live and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._loop.live:
            logger.warning("shutdown: aborting %d unfinished request(s)", len(self._loop.live))
        self._send(Stop())
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, max(1.0, deadline - time.monotonic() + 1.0))
        self._stopped.set()
        await asyncio.to_thread(self.client.close)

    def close(self, timeout_s: float = 5.0) -> None:
        """Synchronous `shutdown` without the grace period: abort everything, join the thread."""
        self._accepting = False
        self._send(Stop())
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._stopped.set()
        self.client.close(timeout_s)

    # ---- the event loop's side ---------------------------------------------------------------------

    async def add_requests(self, specs: Sequence[RequestSpec]) -> RequestStream:
        """Submit requests as one unit (all accepted or none); returns their stream.

        Raises what the core raises (InvalidRequestError, CapacityError, ...) in the caller, or
        EngineStoppedError once shutdown began.
        """
        if not self.accepting:
            raise EngineStoppedError("the server is shutting down")
        if not specs:
            raise ValueError("add_requests needs at least one request")
        self.start()
        stream = RequestStream(self, [s.request_id for s in specs], asyncio.get_running_loop(),
                               self._max_stream_backlog)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._send(Submit(list(specs), stream, done))
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
            self._send(Abort(ids))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps (in-process core only; across the process
        boundary use `utility`)."""
        self._needs_engine()
        if self._stopped.is_set():
            return fn(self.engine)  # type: ignore[arg-type] - no thread left to race with
        self.start()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._send(Call(fn, done))
        return await asyncio.wrap_future(done)

    def call_blocking(self, fn: Callable[[LLMEngine], T], timeout_s: float = 30.0) -> T:
        """`call` for synchronous code on another thread (tests, tools); never from the event loop."""
        self._needs_engine()
        if self._stopped.is_set():
            return fn(self.engine)  # type: ignore[arg-type]
        self.start()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._send(Call(fn, done))
        return done.result(timeout_s)

    async def utility(self, name: str, *args: Any) -> Any:
        """Run one of the core's named utilities (`tokenloop.core.core_loop.UTILITIES`) between steps."""
        self.start()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._send(Utility(name, list(args), done))
        return await asyncio.wrap_future(done)

    def utility_blocking(self, name: str, *args: Any, timeout_s: float = 30.0) -> Any:
        """`utility` for synchronous code on another thread; never from the event loop."""
        self.start()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._send(Utility(name, list(args), done))
        return done.result(timeout_s)

    def _needs_engine(self) -> None:
        if self.engine is None:
            raise TypeError("call(fn) needs the in-process engine; the core runs in its own process: "
                            "use utility(name, ...)")

    def _send(self, command: Command) -> None:
        self._commands.send(command)

    # ---- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop.run()
        finally:
            self._stopped.set()
            self._loop.refuse_the_rest()
