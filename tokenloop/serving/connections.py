"""Connections are not requests: the HTTP protocol the server runs under uvicorn, and its open-file budget.

uvicorn's `limit_concurrency` counts sockets and answers 503 to every request past it, so a client holding
a few hundred idle connections locked everyone out. Here a socket costs only a file descriptor and a few
kilobytes until it brings a complete request head:
- a connection without a request in flight (no head yet, or between keep-alive requests) is *idle*; it is
  closed `header_read_timeout_s` after it opened or after its last response;
- past `max_connections` open sockets (at most what the open-file limit allows, less a reserve for the
  server's own files) a new connection closes the oldest idle one; only when every connection has a
  request in flight is the new one refused (closed at once);
- requests in flight are limited by `limits.EdgeGuard`, which answers 503 in OpenAI's shape.
A request the HTTP parser (h11) rejects gets OpenAI's error body too, not uvicorn's plain text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections import OrderedDict

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenloop.config import ServerLimits

logger = logging.getLogger(__name__)

# File descriptors kept for everything but client sockets: the listening socket, the engine core's ZMQ
# sockets, model and log files, the prep workers' and Ray's pipes.
FD_RESERVE = 256


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit where the system allows it; (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # a hard limit of 'unlimited' some kernels refuse as a soft one
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft, hard


def connection_budget(limits: ServerLimits) -> int:
    """How many client connections may be open at once: the flag, within the open-file limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    return max(1, min(limits.max_connections, soft - FD_RESERVE))


class ConnectionTable:
    """The server's idle connections, oldest first, and the cap on open ones."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self.idle: OrderedDict[H11Protocol, None] = OrderedDict()
        self.evicted = 0  # idle connections closed to make room (for tests and logs)

    def make_room(self, newcomer: H11Protocol, num_open: int) -> bool:
        """Close the oldest idle connections until `num_open` fits; False if only busy ones are left."""
        while num_open > self.max_connections:
            oldest = next((p for p in self.idle if p is not newcomer), None)
            if oldest is None:
                return False
            self.idle.pop(oldest)
            oldest.transport.close()
            self.evicted += 1
            num_open -= 1
        return True


_REASONS = {400: b"Bad Request", 413: b"Content Too Large", 414: b"URI Too Long",
            431: b"Request Header Fields Too Large", 505: b"HTTP Version Not Supported"}


class _RecordingConnection(h11.Connection):
    """h11's connection, keeping the parse error uvicorn catches and drops (its text and status hint)."""

    last_error: h11.RemoteProtocolError | None = None

    def next_event(self):  # type: ignore[no-untyped-def]  # h11's own signature
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            self.last_error = exc
            raise


# long: one class, built over the limits and the connection table it closes on; each method is short.
def guarded_h11(limits: ServerLimits, table: ConnectionTable) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header-read deadline, idle-connection eviction and JSON parse errors."""
    header_read_timeout_s = limits.header_read_timeout_s

    class GuardedH11Protocol(H11Protocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            self.conn = _RecordingConnection(h11.SERVER, self.conn._max_incomplete_event_size)

        def _arm(self) -> None:
            self._disarm()
            self._header_deadline = self.loop.call_later(header_read_timeout_s, self._headers_too_slow)
            table.idle[self] = None
            table.idle.move_to_end(self)

        def _disarm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None
            table.idle.pop(self, None)

        def _headers_too_slow(self) -> None:
            self._header_deadline = None
            table.idle.pop(self, None)
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()
            if not table.make_room(self, len(self.connections)):
                self._disarm()
                transport.close()  # every other connection has a request in flight

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # the head is in: a request in flight (the body has its own timeout)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # idle again: the next request on this keep-alive connection gets a deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            error = self.conn.last_error
            status = error.error_status_hint if error is not None else 400
            reason = _REASONS.get(status, b"Bad Request")
            detail = str(error) if error is not None and str(error) else "it could not be parsed"
            detail = "".join(ch if " " <= ch <= "~" else "?" for ch in detail[:200])  # one printable line
            body = json.dumps({"error": {"message": f"the HTTP request is malformed: {detail}",
                                         "type": "invalid_request_error", "param": None,
                                         "code": "invalid_http_request"}}).encode()
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True  # a request already handed to the app: its answer is this one
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            # Framed by h11 as uvicorn's own 400 is (h11 allows a response after the peer's error).
            for event in (h11.Response(status_code=status, headers=headers, reason=reason), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event) or b"")
            self.transport.close()

    return GuardedH11Protocol
