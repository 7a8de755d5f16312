"""The engine core's own process: a `CoreLoop` between two ZMQ sockets.

The front end binds a PUSH socket (its messages in) and a PULL socket (frames out) on ipc:// paths in a
private temp dir and starts `run_core_process` with the spawn start method, or by fork while it still runs
one thread (`tokenloop serve`, to skip importing torch again; with other threads the child would inherit
their locks mid-state). The core builds its EngineCore, sends `CoreReady`, then:

    receive every pending message (without blocking while busy; polling while idle) -> apply them in order
    -> step when there is work -> send one `CoreFrame` (outputs, records, answers)

It exits on `Shutdown`, or on its own when the parent process is gone (its parent pid changes). A heartbeat
thread tells the front end that the loop still makes progress, so a core that hangs without exiting is
noticed too (`tokenloop.core.heartbeat`). `run_core`
is the same loop for any host of the core (a Ray actor too), told by a callable when to give up.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from tokenloop.core import wire
from tokenloop.core.heartbeat import HeartbeatThread
from tokenloop.core.messages import CoreReady
from tokenloop.heap import settle_startup_heap

if TYPE_CHECKING:
    from tokenloop.config import EngineConfig
    from tokenloop.model.loader import Checkpoint

logger = logging.getLogger(__name__)

# Poll timeouts: idle, the core wakes this often only to see whether its parent is still there; with
# requests that could not be scheduled (the pool is full) it waits a little for a change, not spinning.
_IDLE_POLL_MS = 500
_NOTHING_SCHEDULED_POLL_MS = 5
_SEND_LINGER_MS = 2000  # the last frame (the shutdown's finals) still reaches the front end


def run_core_process(config: EngineConfig, checkpoint: Checkpoint | None, input_address: str,
                     output_address: str, parent_pid: int, log_level: int = logging.INFO,
                     heartbeat: tuple[str, float] | None = None) -> None:
    """The engine process's main (the spawn target). Exit status 0 after a shutdown, 1 if building failed."""
    # Ctrl-C reaches the whole process group; the front end decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # force: a forked core inherits the front end's handlers, and its lines must still say [core]
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [core] %(name)s: %(message)s",
                        force=True)
    sys.exit(run_core(config, checkpoint, input_address, output_address, lambda: _parent_gone(parent_pid),
                      heartbeat))


def run_core(config: EngineConfig, checkpoint: Checkpoint | None, input_address: str, output_address: str,
             should_stop: Callable[[], bool], heartbeat: tuple[str, float] | None = None) -> int:
    """Build the core, announce it on `output_address`, then serve until `Shutdown` or `should_stop()`.

    The loop of every engine core behind sockets (its own process here, a Ray actor in a cluster): only
    how it learns that nobody listens any more differs, hence `should_stop`, asked once per turn. With
    `heartbeat` (address, interval in s), a thread reports the core's progress to that address that often
    once the core is ready (`tokenloop.core.heartbeat`).
    Returns 0 after a shutdown, 1 if building failed.
    """
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, _SEND_LINGER_MS)
    inputs.connect(input_address)
    outputs.connect(output_address)
    beating = None
    try:
        loop = _build(config, checkpoint, outputs)
        if loop is None:
            return 1
        if heartbeat is not None:
            beating = HeartbeatThread(context, heartbeat[0], loop.core.progress, heartbeat[1]).start()
        _serve(loop, inputs, outputs, should_stop)
        return 0
    finally:
        if beating is not None:
            beating.stop()
        inputs.close(linger=0)
        outputs.close()
        context.term()


def _parent_gone(parent_pid: int) -> bool:
    if os.getppid() == parent_pid:
        return False
    # Reparented: the front end is gone, nobody will read our outputs.
    logger.warning("the front end (pid %d) is gone; the engine core exits", parent_pid)
    return True


def _build(config: EngineConfig, checkpoint: Checkpoint | None, outputs: zmq.Socket):
    """Build the core and announce it; on failure announce why and return None."""
    try:
        from tokenloop.core.core_loop import CoreLoop, RecordBuffer, inject_faults_from_env
        from tokenloop.core.engine_core import EngineCore

        buffer = RecordBuffer()
        core = EngineCore(config, checkpoint, observers=[buffer])
        inject_faults_from_env(core)
    except Exception as exc:
        logger.exception("building the engine core failed")
        error = wire.error_to_wire(exc)
        error.message = f"{error.message}\n{traceback.format_exc(limit=5)}"
        outputs.send(wire.encode(CoreReady(os.getpid(), 0, 0, 0, 0, "", error)))
        return None
    kv = core.kv_cache
    # The model, tokenizer and pool out of the collector's sight, and collections rarer: each full one
    # walks every token list of every running request (at 256 requests of 2,048 tokens the default
    # thresholds tripled the step's overhead; see BENCHMARKS.md).
    settle_startup_heap()
    outputs.send(wire.encode(CoreReady(os.getpid(), core.max_model_len, core.vocab_size, kv.num_blocks,
                                       kv.block_size, core.dtype_choice.describe() if core.dtype_choice else "")))
    return CoreLoop(core, buffer)


def _serve(loop, inputs: zmq.Socket, outputs: zmq.Socket, should_stop: Callable[[], bool]) -> None:
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    progress = loop.core.progress
    while not loop.stopped:
        progress.tick()  # every turn, idle ones too: a loop that stops turning is hung
        if not loop.has_work:
            timeout = _IDLE_POLL_MS
        elif loop.last_num_scheduled == 0:
            timeout = _NOTHING_SCHEDULED_POLL_MS
        else:
            timeout = 0  # busy: look at the socket between steps, never wait on it
        if poller.poll(timeout):
            while True:
                try:
                    frame = inputs.recv(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                for message in wire.decode_batch(frame):
                    loop.apply(message)
        if should_stop():
            return
        try:
            frame_out = loop.turn()
        except Exception as exc:
            logger.exception("the engine core's step failed")
            outputs.send(wire.encode(CoreReady(os.getpid(), 0, 0, 0, 0, "", wire.error_to_wire(exc))))
            raise
        if frame_out is not None:
            outputs.send(wire.encode(frame_out), copy=False)
