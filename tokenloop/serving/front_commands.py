"""What the event loop asks of the engine thread: commands on a locked list, with a wakeup pipe.

The event loop's side (`AsyncEngine`) sends; the engine thread (`FrontLoop`) takes them all once per turn
and sleeps in one poll on the pipe's read end between turns. Once the thread has exited the queue is
closed: a command sent then is refused at once, so no caller waits forever.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenloop.errors import EngineStoppedError
from tokenloop.serving.streams import RequestSpec, RequestStream

if TYPE_CHECKING:
    from tokenloop.engine import LLMEngine


@dataclass
class Submit:
    """Requests submitted as one unit: all accepted or none (`done` says which)."""

    specs: list[RequestSpec]
    stream: RequestStream
    done: concurrent.futures.Future[None]


@dataclass
class Abort:
    """Requests to end now, wherever they are."""

    request_ids: list[str]


@dataclass
class Call:
    """`fn(engine)` on the engine thread between steps (the in-process core only)."""

    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future[Any]


@dataclass
class Utility:
    """One of the core's named utilities, run between its steps (wherever the core runs)."""

    name: str
    args: list[Any]
    done: concurrent.futures.Future[Any]


@dataclass
class Stop:
    """End the engine thread: live requests are aborted, later commands refused."""


Command = Submit | Abort | Call | Utility | Stop


class CommandQueue:
    """The commands for the engine thread and the pipe that wakes it; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._commands: list[Command] = []  # guarded by _lock
        self._closed = False  # guarded by _lock: set once the engine thread has exited
        self.wake_fd, self._wake_write = os.pipe()  # the engine thread polls wake_fd
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_write, False)

    def send(self, command: Command) -> None:
        """Queue `command` and wake the engine thread; refuse it if the thread is gone."""
        with self._lock:
            if self._closed:  # nobody would ever answer
                refuse(command)
                return
            self._commands.append(command)
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wakeups already

    def is_empty(self) -> bool:
        with self._lock:
            return not self._commands

    def take(self) -> list[Command]:
        """Every queued command, oldest first (the engine thread, once per turn)."""
        with self._lock:
            commands, self._commands = self._commands, []
        return commands

    def put_back(self, commands: Sequence[Command]) -> None:
        """Commands taken but not applied (those after a Stop): first in line for whoever drains next."""
        with self._lock:
            self._commands[:0] = commands

    def drain_wakeups(self) -> None:
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> list[Command]:
        """Refuse every later command; returns those still queued, for the caller to refuse."""
        with self._lock:
            commands, self._commands = self._commands, []
            self._closed = True
        return commands


def refuse(command: Any, why: str = "the engine has stopped") -> None:
    """Fail a command's caller with EngineStoppedError (a command without a caller needs nothing)."""
    done = getattr(command, "done", None)
    # A call sent to the core is running already (the engine thread took it); a new one may be cancelled.
    if done is not None and not done.done() and (done.running() or done.set_running_or_notify_cancel()):
        done.set_exception(EngineStoppedError(why))
