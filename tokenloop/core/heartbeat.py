"""The engine core's liveness: a progress counter, the heartbeat that carries it, the watch that judges it.

A core can stop without exiting (SIGSTOP, a deadlock, a busy loop, a native call that holds the GIL). Its
process sentinel never fires then, so the front end watches progress instead:

    core process: the loop ticks `Progress` once per turn, the model once per layer; a `HeartbeatThread`
                  sends `CoreHeartbeat(progress)` every interval on a socket of its own (ZMQ sockets are
                  not shared between threads) to the front end's heartbeat socket, which keeps the latest
    front end:    `HangWatch` looks at the latest beat a few times per bound and notes when the counter
                  last moved; past `hang_timeout_s` the core is hung (killed, and handled as a dead one)

One bound tells a long step from a hang: a step is made of layers, and each layer ticks, so a step may take
far longer than the bound as long as no single layer does. A loop that spins or waits on a lock ticks
nothing while its heartbeat thread still beats ("no progress"); a stopped process, or one whose GIL a
native call holds, sends nothing ("no heartbeat"). The idle loop turns every 0.5 s, so it ticks too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenloop.errors import ConfigError

if TYPE_CHECKING:  # `tokenloop serve` reads the defaults here before it starts the core: nothing heavy yet
    import torch
    import zmq

    from tokenloop.core.messages import CoreHeartbeat

logger = logging.getLogger(__name__)

DEFAULT_HANG_TIMEOUT_S = 5.0
MIN_HANG_TIMEOUT_S = 1.0  # above the idle loop's 0.5 s turn, with room for a heartbeat in between


def heartbeat_interval_s(hang_timeout_s: float) -> float:
    """How often the core beats for a front end that waits `hang_timeout_s`: several beats per bound."""
    return min(0.5, hang_timeout_s / 8)


def check_hang_timeout(hang_timeout_s: float) -> float:
    """`hang_timeout_s` if usable (0 turns the watch off); ConfigError otherwise."""
    if hang_timeout_s != 0 and not hang_timeout_s >= MIN_HANG_TIMEOUT_S:
        raise ConfigError(f"--hang-timeout must be 0 (off) or at least {MIN_HANG_TIMEOUT_S:g} s, "
                          f"not {hang_timeout_s!r}")
    return float(hang_timeout_s)


class Progress:
    """A counter the core's main thread advances as it works (per loop turn, per model layer).

    One int under the GIL: the heartbeat thread reads it, only the main thread writes it. A native call that
    runs every layer of a step (csrc/decode_layers.cpp) releases the GIL and ticks `layer_ticks`, a one-element
    int64 tensor, after each layer instead: the count includes it, so a step slowed by a crowded machine still
    shows progress layer by layer, as the Python forward's steps do.
    """

    __slots__ = ("turns", "layer_ticks")

    def __init__(self, layer_ticks: torch.Tensor | None = None) -> None:
        self.turns = 0
        self.layer_ticks = layer_ticks

    @property
    def count(self) -> int:
        return self.turns + (0 if self.layer_ticks is None else int(self.layer_ticks[0]))

    def tick(self) -> None:
        self.turns += 1


class HeartbeatThread:
    """Sends the core's progress to the front end every `interval_s`, from a thread of its own, on a socket
    of its own that keeps only the latest beat (ZMQ_CONFLATE): the front end reads it when it looks."""

    def __init__(self, context: zmq.Context, address: str, progress: Progress, interval_s: float) -> None:
        self._context, self._address = context, address
        self._progress, self._interval_s = progress, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenloop-core-heartbeat", daemon=True)

    def start(self) -> HeartbeatThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and close the socket (before the context is terminated, which waits for it)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        import zmq

        from tokenloop.core import wire
        from tokenloop.core.messages import CoreHeartbeat

        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.CONFLATE, 1)
        try:
            socket.connect(self._address)
            while not self._stop.is_set():
                try:
                    socket.send(wire.encode(CoreHeartbeat(self._progress.count)), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # not connected yet: the next beat says the same
                self._stop.wait(self._interval_s)
        except Exception:  # without beats the front end declares a hang: log why
            logger.exception("the engine core's heartbeat stopped")
        finally:
            socket.close(linger=0)


class HangWatch:
    """The front end's judgement of one core: hung when its progress has not moved for `hang_timeout_s`.

    The front end looks every quarter of the bound (`due`, then `look` with the latest beat, or None when
    none came since the last look), so a hang is declared between the bound and 1.25 times it (plus one
    beat's interval) after the core's last progress. Armed once the core is ready (its start has its own
    timeout); `hang_timeout_s` 0 never declares a hang.
    """

    def __init__(self, hang_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.hang_timeout_s = check_hang_timeout(hang_timeout_s)
        self._period_s = self.hang_timeout_s / 4
        self._clock = clock
        self._progress = -1
        self._moved_s = 0.0  # when the counter was last seen to move
        self._heard_s = 0.0  # when the last beat was seen
        self._next_look_s: float | None = None  # None: not armed

    def arm(self) -> None:
        if self.hang_timeout_s:
            self._moved_s = self._heard_s = now = self._clock()
            self._next_look_s = now + self._period_s

    def due(self) -> bool:
        """Time to look at the latest beat (a clock read: cheap enough for every turn of the front end)."""
        return self._next_look_s is not None and self._clock() >= self._next_look_s

    def look(self, beat: CoreHeartbeat | None) -> str | None:
        """Take the latest beat (None: none since the last look); why the core is hung, or None."""
        now = self._clock()
        self._next_look_s = now + self._period_s
        if beat is not None:
            self._heard_s = now
            if beat.progress != self._progress:
                self._progress, self._moved_s = beat.progress, now
        stalled = now - self._moved_s
        if stalled <= self.hang_timeout_s:
            return None
        if now - self._heard_s > self.hang_timeout_s:
            detail = "no heartbeat: the process is stopped, or a native call holds its GIL"
        else:
            detail = "it beats but its loop makes no progress: a deadlock or a busy loop on its main thread"
        return f"the engine core stopped responding for {stalled:.1f} s ({detail})"

    def timeout_ms(self) -> int | None:
        """How long the front end may sleep before its next look (None: not watching)."""
        if self._next_look_s is None:
            return None
        return max(0, int((self._next_look_s - self._clock()) * 1000) + 1)
