"""The front end's clients of the engine core: in this process, or in its own process over ZMQ.

Both speak the same messages (`tokenloop.core.messages`) and give back `CoreFrame`s, so one front-end
loop (`AsyncEngine`'s engine thread) drives either:

    client.send([AddRequests(...), FinishRequests(...)])   # applied in order, between two steps
    poller waits on client.pollables() (and the front end's own wakeup) for client.poll_timeout_ms()
    for frame in client.receive(): ...                      # one frame per core step
    client.death()                                          # why the core is gone (dead, or hung and
                                                            # killed), or None
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from tokenloop.core import wire
from tokenloop.core.core_launch import StartedCore, heartbeat_address, socket_addresses, start_core_process
from tokenloop.core.core_loop import CoreLoop, RecordBuffer
from tokenloop.core.heartbeat import (
    DEFAULT_HANG_TIMEOUT_S,
    HangWatch,
    check_hang_timeout,
    heartbeat_interval_s,
)
from tokenloop.core.messages import CoreFrame, CoreReady, InputMessage, Shutdown
from tokenloop.core.private_dir import PrivateDir
from tokenloop.errors import EngineStoppedError, ModelLoadError

if TYPE_CHECKING:
    from tokenloop.config import EngineConfig
    from tokenloop.core.engine_core import EngineCore
    from tokenloop.model.loader import Checkpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreInfo:
    """What the front end learns from the core before it serves anyone."""

    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    dtype: str
    pid: int


class CoreClient(Protocol):
    info: CoreInfo

    def send(self, messages: list[InputMessage]) -> None: ...

    def receive(self) -> list[CoreFrame]: ...

    def pollables(self) -> list[Any]: ...

    def poll_timeout_ms(self) -> int | None: ...

    def death(self) -> str | None: ...

    def close(self, timeout_s: float = 5.0) -> None: ...


class InProcessCoreClient:
    """The core on the caller's thread: `receive` runs one turn of its loop (one step when there is work)."""

    def __init__(self, core: EngineCore, *, records_in_frames: bool = False) -> None:
        self.core = core
        buffer = None
        if records_in_frames:  # as across a process boundary: the frames carry the records (a replica set)
            buffer = RecordBuffer()
            core.observers.add(buffer)
        # Without a buffer the core's own observers see every record.
        self.loop = CoreLoop(core, buffer)
        kv = core.kv_cache
        self.info = CoreInfo(core.max_model_len, core.vocab_size, kv.num_blocks, kv.block_size,
                             core.dtype_choice.describe(), os.getpid())

    def send(self, messages: list[InputMessage]) -> None:
        for message in messages:
            self.loop.apply(message)

    def receive(self) -> list[CoreFrame]:
        frame = self.loop.turn()
        return [frame] if frame is not None else []

    def pollables(self) -> list[Any]:
        return []

    def poll_timeout_ms(self) -> int | None:
        loop = self.loop
        if loop.has_pending:
            return 0
        if loop.has_work:
            return 0 if loop.last_num_scheduled else 5  # nothing fitted: wait a little for a change
        return None

    def death(self) -> str | None:
        return None

    def close(self, timeout_s: float = 5.0) -> None:
        if not self.loop.stopped:
            self.loop.apply(Shutdown())
            self.loop.turn()


class CoreSockets:
    """The front end's sockets to one engine core, bound on ipc:// paths in a private temp dir (mode 0700,
    locked while this process lives): PUSH for its messages in, PULL for its frames out, and a PULL that
    keeps only the latest of its heartbeats, judged by a `HangWatch` (`hang_timeout_s` 0: not watched).
    Whoever hosts the core (a process, a Ray actor on this host) connects it to `input_address`,
    `output_address` and `heartbeat_address`."""

    def __init__(self, directory: PrivateDir | None = None, *,
                 hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> None:
        self.watch = HangWatch(hang_timeout_s)  # first: a bad bound is refused before anything is made
        self.directory = directory if directory is not None else PrivateDir.create()
        self._context = zmq.Context()
        self.inputs = self._context.socket(zmq.PUSH)
        self.outputs = self._context.socket(zmq.PULL)
        self.heartbeats = self._context.socket(zmq.PULL)
        self.heartbeats.setsockopt(zmq.CONFLATE, 1)
        for socket in (self.inputs, self.outputs, self.heartbeats):
            socket.setsockopt(zmq.LINGER, 0)
        self.input_address, self.output_address = socket_addresses(self.directory.path)
        self.heartbeat_address = heartbeat_address(self.directory.path)
        self.inputs.bind(self.input_address)
        self.outputs.bind(self.output_address)
        self.heartbeats.bind(self.heartbeat_address)

    @property
    def heartbeat_interval_s(self) -> float:
        """How often the core should beat for this watch (`hang_timeout_s` 0: the default interval)."""
        return heartbeat_interval_s(self.watch.hang_timeout_s or DEFAULT_HANG_TIMEOUT_S)

    def wait_ready(self, timeout_s: float, what: str, sentinel: Any,
                   death: Callable[[], str | None]) -> CoreInfo:
        """The core's `CoreReady` as a CoreInfo; ModelLoadError with the core's reason if it could not
        build, EngineStoppedError if `sentinel` (readable once `what` is gone) fires or time runs out."""
        poller = zmq.Poller()
        poller.register(self.outputs, zmq.POLLIN)
        poller.register(sentinel, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise EngineStoppedError(f"{what} did not become ready in {timeout_s:.0f} s")
            ready = dict(poller.poll(left_ms))
            if self.outputs in ready:
                message = wire.decode(self.outputs.recv())
                if not isinstance(message, CoreReady):
                    raise EngineStoppedError(f"{what} sent {type(message).__name__} before it was ready")
                if message.error is not None:
                    raise ModelLoadError(f"the engine core failed to start: {message.error.kind}: "
                                         f"{message.error.message}")
                self.watch.arm()
                return CoreInfo(message.max_model_len, message.vocab_size, message.num_blocks,
                                message.block_size, message.dtype, message.pid)
            why = death()
            if why is not None:
                raise EngineStoppedError(f"{why} while starting")

    def send(self, messages: list[InputMessage]) -> None:
        """Send a batch as one frame; raises wire.UnsendableMessages (after sending the rest) for messages
        holding a value msgpack cannot encode."""
        if messages:
            frame, failures = wire.encode_sendable(messages)
            if frame is not None:
                self.inputs.send(frame, copy=False)
            if failures:
                raise wire.UnsendableMessages(failures)

    def send_shutdown(self) -> None:
        try:
            self.inputs.send(wire.encode_batch([Shutdown()]), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # nobody connected (the core is gone or never came): nothing to tell

    def receive(self) -> list[CoreFrame]:
        """Every frame that has arrived, without waiting."""
        frames = []
        while True:
            try:
                data = self.outputs.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return frames
            message = wire.decode(data)
            if isinstance(message, CoreReady) and message.error is not None:  # the core's last words
                logger.critical("the engine core failed: %s: %s", message.error.kind, message.error.message)
                continue
            frames.append(message)

    def hang(self) -> str | None:
        """Why the core counts as hung (its progress stood still for the bound), or None."""
        watch = self.watch
        if not watch.due():
            return None
        try:
            beat = wire.decode(self.heartbeats.recv(zmq.NOBLOCK))
        except zmq.Again:
            beat = None
        return watch.look(beat)

    def close(self) -> None:
        for socket in (self.inputs, self.outputs, self.heartbeats):
            socket.close(linger=0)
        self._context.term()
        self.directory.remove()


class CoreProcessClient:
    """Starts the engine core in its own process (or takes `started`, one already started for `config`)
    and talks to it over ipc:// sockets.

    The constructor returns once the core is ready (or raises ModelLoadError with the core's reason, or
    EngineStoppedError if it died or stayed silent for `startup_timeout_s`); with `wait=False` it returns
    at once, and the first read of `info` waits instead, so the caller works while the core loads. Once
    ready, a core whose progress stands still for `hang_timeout_s` (0: never; a core started without a
    heartbeat is not watched) is killed and reported dead by `death`.
    """

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None, *,
                 startup_timeout_s: float = 300.0, log_level: int | None = None,
                 started: StartedCore | None = None, wait: bool = True,
                 hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> None:
        check_hang_timeout(hang_timeout_s)
        if started is None:
            beat = heartbeat_interval_s(hang_timeout_s) if hang_timeout_s else None
            started = start_core_process(config, checkpoint, log_level=log_level, heartbeat_interval_s=beat)
        elif started.heartbeat_interval_s is None:
            hang_timeout_s = 0.0  # it never beats: nothing to judge it by
        self.process = started.process
        self._startup_timeout_s = startup_timeout_s
        self._info: CoreInfo | None = None
        self._closed = False
        self._hang: str | None = None  # why it was killed as hung
        # Bound after the start, so that a forked child holds no ZMQ context of this process: its sockets
        # connect whenever these exist (ZMQ retries) and queue what they send till then.
        try:
            self._sockets = CoreSockets(started.directory, hang_timeout_s=hang_timeout_s)
        except BaseException:
            self.process.kill()
            started.directory.remove()
            raise
        if wait:
            _ = self.info

    @property
    def info(self) -> CoreInfo:
        """What the core announced when it became ready (waits for it the first time)."""
        if self._info is None:
            try:
                self._info = self._sockets.wait_ready(self._startup_timeout_s, "the engine core process",
                                                      self.process.sentinel, self.death)
            except BaseException:
                self.close(timeout_s=1.0)
                raise
        return self._info

    def send(self, messages: list[InputMessage]) -> None:
        self._sockets.send(messages)

    def receive(self) -> list[CoreFrame]:
        """Every frame that has arrived, without waiting."""
        return self._sockets.receive()

    def pollables(self) -> list[Any]:
        # The sentinel becomes readable the moment the process exits: death is seen at once, not polled.
        return [self._sockets.outputs, self.process.sentinel]

    def poll_timeout_ms(self) -> int | None:
        # The core steps on its own; its frames and its death both wake the poller, its hang the timeout.
        return self._sockets.watch.timeout_ms()

    def death(self) -> str | None:
        if self._hang is not None:
            return self._hang
        code = self.process.exitcode
        if code is not None:
            return f"the engine core process died (exit code {code})"
        hang = self._sockets.hang()
        if hang is not None:  # nothing left behind: a stopped or stuck process is killed here and now
            self._hang = f"{hang}; it was killed"
            self.process.kill()
            self.process.join(5.0)
        return self._hang

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask the core to shut down, wait for it (then kill it), and remove the sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        process = self.process
        if process.pid is not None and process.exitcode is None:
            self._sockets.send_shutdown()
            process.join(timeout_s)
            if process.exitcode is None:
                logger.warning("the engine core did not exit in %.1f s; killing it", timeout_s)
                process.kill()
                process.join(timeout_s)
        self._sockets.close()
