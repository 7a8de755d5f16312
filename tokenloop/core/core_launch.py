"""Starting the engine core's process, with nothing heavier than the standard library imported.

`tokenloop serve` starts its core first and imports the web framework (and torch, for itself) while the
core loads the model: this module is all it needs for that, so the start comes before those imports. The
process target imports the core (`tokenloop.core.core_process`) in the child. `CoreProcessClient`
(tokenloop.serving.core_client) binds the sockets and talks to it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Literal

from tokenloop.core.private_dir import PrivateDir

if TYPE_CHECKING:
    from tokenloop.config import EngineConfig
    from tokenloop.model.loader import Checkpoint

logger = logging.getLogger(__name__)

StartMethod = Literal["spawn", "fork"]


@dataclass(frozen=True)
class StartedCore:
    """An engine core process that has been started, and the private directory of its sockets' paths."""

    process: BaseProcess
    directory: PrivateDir  # locked by this process until removed (a dead server's is reaped by the next)
    started_s: float  # time.perf_counter() when it started
    heartbeat_interval_s: float | None = None  # how often it beats once ready (None: never)


def socket_addresses(directory: str) -> tuple[str, str]:
    """The ipc:// addresses of the core's input and output sockets in `directory`."""
    return f"ipc://{directory}/input", f"ipc://{directory}/output"


def heartbeat_address(directory: str) -> str:
    """The ipc:// address of the socket where the core's heartbeats arrive (`tokenloop.core.heartbeat`)."""
    return f"ipc://{directory}/heartbeat"


def start_core_process(config: EngineConfig, checkpoint: Checkpoint | None = None, *,
                       start_method: StartMethod = "spawn", log_level: int | None = None,
                       heartbeat_interval_s: float | None = None) -> StartedCore:
    """Start the core's process; it connects to the sockets in the returned directory once they exist,
    and beats every `heartbeat_interval_s` once ready (None: never; `tokenloop.core.heartbeat`).

    "fork" lets the child keep what this process has imported (a spawned child starts a fresh interpreter
    and imports torch again, ~1.5 s): only while this process runs no other Python thread, whose locks
    (logging's, say) the child would inherit held; otherwise it spawns. A library's own worker threads
    (numpy's OpenBLAS starts some at import) stop themselves around a fork (pthread_atfork).
    """
    if start_method == "fork" and threading.active_count() > 1:
        logger.debug("other threads run here: the engine core starts by spawn, not fork")
        start_method = "spawn"
    directory = PrivateDir.create()  # mode 0700: only this user reaches the sockets
    input_address, output_address = socket_addresses(directory.path)
    level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
    heartbeat = (None if heartbeat_interval_s is None
                 else (heartbeat_address(directory.path), heartbeat_interval_s))
    # typeshed's BaseContext lacks Process; every context get_context returns has it.
    process = multiprocessing.get_context(start_method).Process(  # type: ignore[attr-defined]
        target=_run_core_process, name="tokenloop-engine-core", daemon=True,
        args=(config, checkpoint, input_address, output_address, os.getpid(), level, heartbeat))
    try:
        process.start()
    except BaseException:
        directory.remove()
        raise
    return StartedCore(process, directory, time.perf_counter(), heartbeat_interval_s)


def _run_core_process(config: EngineConfig, checkpoint: Checkpoint | None, input_address: str,
                      output_address: str, parent_pid: int, log_level: int,
                      heartbeat: tuple[str, float] | None) -> None:
    from tokenloop.core.core_process import run_core_process

    run_core_process(config, checkpoint, input_address, output_address, parent_pid, log_level, heartbeat)
