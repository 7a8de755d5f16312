"""Running the app under uvicorn: in the foreground (the CLI), or on a background thread (tests, soak).

Graceful shutdown on SIGINT/SIGTERM: uvicorn stops accepting connections and waits up to
`shutdown_timeout_s` for in-flight responses, cancelling them after that (which aborts their requests);
then the app's lifespan shuts the engine thread down. uvicorn re-raises the captured signal once it
has finished; `serve_forever` installs no-op handlers first so that re-raise ends in a clean exit 0.
Once started, the process's heap is frozen and its collections made rarer (`tokenloop.heap`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
import threading
import time
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from tokenloop.config import ServerLimits
from tokenloop.heap import settle_startup_heap
from tokenloop.serving.connections import ConnectionTable, connection_budget, guarded_h11, raise_open_file_limit

logger = logging.getLogger(__name__)


# uvicorn's own deadline, past the engine's: by then every stream has ended with finish_reason 'abort'.
_UVICORN_GRACE_S = 3.0


class _Server(uvicorn.Server):
    """uvicorn, plus: when shutdown begins, the engine starts draining at the same moment.

    uvicorn only tells the app (lifespan shutdown) after every connection has closed, and cancels
    responses still running at its deadline, which cuts streams mid-body. Draining the engine right
    away instead lets requests finish for `shutdown_timeout_s`, then ends the rest properly: an
    'abort' finish and [DONE] for streams, a 503 for the others.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self._app = app
        self._shutdown_timeout_s = shutdown_timeout_s
        self.engine_died = False  # the process must exit non-zero so that a supervisor restarts it
        self.connection_table: ConnectionTable | None = None

    async def on_tick(self, counter: int) -> bool:
        async_engine = getattr(self._app.state, "async_engine", None)
        if async_engine is not None and async_engine.crashed and not self.engine_died:
            why = getattr(async_engine, "death", None) or "the engine thread died"
            logger.critical("%s: shutting down so that a supervisor can restart the server", why)
            self.engine_died = True
            self.should_exit = True
        return await super().on_tick(counter)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            # Everything the app holds now lives as long as the server: out of the collector's sight, a
            # full collection during a huge request body no longer stalls every stream and /health.
            settle_startup_heap()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        async_engine = getattr(self._app.state, "async_engine", None)
        drain = None
        if async_engine is not None:
            drain = asyncio.ensure_future(async_engine.shutdown(self._shutdown_timeout_s))
        await super().shutdown(sockets)
        if drain is not None:
            await drain


def _make_server(app: FastAPI, host: str, port: int, shutdown_timeout_s: float, log_level: str) -> _Server:
    limits = getattr(app.state, "limits", None) or ServerLimits()
    table = ConnectionTable(connection_budget(limits))
    # No limit_concurrency: uvicorn's counts sockets; requests in flight are counted by EdgeGuard. No
    # WebSockets: an Upgrade header is ignored and the request served as plain HTTP.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", access_log=False,
                            timeout_graceful_shutdown=math.ceil(shutdown_timeout_s + _UVICORN_GRACE_S),
                            http=guarded_h11(limits, table), ws="none")
    server = _Server(config, app, shutdown_timeout_s)
    server.connection_table = table
    return server


def serve_forever(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, shutdown_timeout_s: float = 5.0,
                  log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully and return (the caller exits 0).

    If the engine thread or the engine core process dies, in-flight requests are failed and this exits
    with status 3.
    """
    soft, hard = raise_open_file_limit()
    logger.info("open-file limit %d (hard %d): up to %d client connections", soft, hard,
                connection_budget(getattr(app.state, "limits", None) or ServerLimits()))
    for sig in (signal.SIGINT, signal.SIGTERM):
        # uvicorn restores these after its own handling and re-raises the signal into them.
        signal.signal(sig, lambda *_: None)
    server = _make_server(app, host, port, shutdown_timeout_s, log_level)
    server.run()
    if not server.started:
        raise SystemExit(1)  # bind failure or a failed startup (uvicorn logged why)
    if server.engine_died:
        raise SystemExit(3)  # in-flight requests were failed; a supervisor restarts the process


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerThread:
    """A uvicorn server on a background thread, bound to 127.0.0.1 on a free port.

        with ServerThread(app) as server:
            httpx.get(server.url + "/health")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, *, shutdown_timeout_s: float = 5.0,
                 log_level: str = "warning") -> None:
        self.app = app
        self.host = host
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))  # bound now, so the port is ours before the thread starts
        self.port: int = self._socket.getsockname()[1]
        self.server = _make_server(app, host, self.port, shutdown_timeout_s, log_level)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]},
                                        name="tokenloop-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
