"""The server's limits, and the ASGI middleware that enforces the first of them before any route runs.

`EdgeGuard` sits outside FastAPI, so it answers before a body is read or parsed:
- the API key, on every route that accepts work or reveals request data (all of /v1, /tokenize,
  /detokenize, /admin); /health, /version, /metrics and the static dashboard page stay open;
- requests in flight: past `max_concurrent_requests` a request is answered 503 (Retry-After) before its
  body is read; the probes (/health, /metrics, /version) are always answered. Idle connections are not
  requests and do not count (see `connections`);
- the body: 413 past `max_body_bytes` (by Content-Length, or by counting while reading), 408 when
  the client does not finish sending it within `body_read_timeout_s`. The body is read here, whole
  and bounded, and replayed to the route;
- an exception that escaped a route after its response was sent is logged once, here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenloop.config import ServerLimits
from tokenloop.errors import ConfigError
from tokenloop.serving.errors import APIError, internal_error, invalid, new_incident_id

logger = logging.getLogger(__name__)

API_KEY_ENV = "TOKENLOOP_API_KEY"
_PROTECTED_PREFIXES = ("/v1/", "/admin/")
_PROTECTED_PATHS = frozenset({"/v1", "/tokenize", "/detokenize", "/admin"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_PROBE_PATHS = frozenset({"/health", "/metrics", "/version"})


def resolve_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key from the flag, else from a file, else from $TOKENLOOP_API_KEY; None: no key."""
    if api_key is not None and api_key_file is not None:
        raise ConfigError("give the API key with --api-key or --api-key-file, not both")
    if api_key_file is not None:
        try:
            api_key = Path(api_key_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the API key file {api_key_file}: {exc.strerror}") from None
        if not api_key:
            raise ConfigError(f"the API key file {api_key_file} is empty")
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    return api_key


def needs_key(path: str) -> bool:
    return path in _PROTECTED_PATHS or path.startswith(_PROTECTED_PREFIXES)


def key_matches(headers: dict[str, str], api_key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


class _BodyError(Exception):
    def __init__(self, error: APIError, close: bool = True) -> None:
        self.error = error
        self.close = close  # the unread rest of the body is still on the wire


class EdgeGuard:
    """ASGI middleware: API key, body size and body read time, checked before the app sees a request."""

    def __init__(self, app: ASGIApp, api_key: str | None, limits: ServerLimits) -> None:
        self.app = app
        self.api_key = api_key
        self.limits = limits
        self.in_flight = 0  # requests being served, probes left out (the event loop's own counter)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = header_dict(scope)
        if self.api_key is not None and needs_key(scope["path"]) and not key_matches(headers, self.api_key):
            await _send_error(send, APIError(401, "Incorrect or missing API key: send `Authorization: Bearer "
                                                  "<key>`.", "invalid_request_error", None, "invalid_api_key"))
            return
        if scope["path"] in _PROBE_PATHS:
            await self._serve(scope, receive, send, headers)
            return
        if self.in_flight >= self.limits.max_concurrent_requests:
            await _send_error(send, APIError(503, f"the server is serving {self.in_flight} requests, its limit; "
                                                  "retry shortly", "server_error", None, "server_overloaded",
                                             headers={"Retry-After": "1"}), close=scope["method"] in _BODY_METHODS)
            return
        self.in_flight += 1
        try:
            await self._serve(scope, receive, send, headers)
        finally:
            self.in_flight -= 1

    async def _serve(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str]) -> None:
        """Read and bound the body, then run the app; an exception that escaped it is answered here."""
        if scope["method"] in _BODY_METHODS:
            try:
                body = await self._read_body(headers, receive)
            except _BodyError as exc:
                await _send_error(send, exc.error, close=exc.close)
                return
            receive = _replay(body, receive)
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:  # the app's handler already answered and logged it, unless not
            if not started:
                incident = new_incident_id()
                logger.exception("unhandled error while serving %s %s (%s)", scope["method"], scope["path"],
                                 incident)
                await _send_error(send, internal_error(incident))

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes:
        limit = self.limits.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and not declared.isdigit():
            raise _BodyError(invalid("the Content-Length header is not a number"))
        # A body somewhat over the limit is read and dropped, so that the client, still sending, gets to
        # read the 413 (a connection closed under it reads as a reset); one far over it is cut off.
        drain_up_to = 4 * limit
        if declared is not None and int(declared) > drain_up_to:
            raise _BodyError(_too_large(limit))
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_read_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise _BodyError(APIError(408, f"the request body did not arrive within "
                                               f"{self.limits.body_read_timeout_s:g} s", "invalid_request_error",
                                          None, "request_timeout")) from None
            if message["type"] == "http.disconnect":
                raise _BodyError(invalid("the client disconnected while sending the body"))
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > drain_up_to:
                raise _BodyError(_too_large(limit))
            if size <= limit:
                chunks.append(chunk)
            if not message.get("more_body", False):
                if size > limit:
                    raise _BodyError(_too_large(limit), close=False)
                return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return invalid(f"the request body is larger than the server's limit of {limit} bytes",
                   code="request_too_large", status=413)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that yields the buffered body once, then waits on the client (for its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _send_error(send: Send, error: APIError, close: bool = False) -> None:
    payload = json.dumps(error.body()).encode()
    headers: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(payload)).encode())]
    if close:  # an unread body is still on the wire: the connection cannot be reused
        headers.append((b"connection", b"close"))
    for name, value in (error.headers or {}).items():
        headers.append((name.lower().encode("latin-1"), value.encode("latin-1")))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def header_dict(scope: Scope) -> dict[str, str]:
    """Request headers by lower-case name (a repeated header keeps its last value)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
