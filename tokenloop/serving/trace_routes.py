"""HTTP routes over the engine's `Tracer`: request traces, and the live dashboard.

    app.include_router(make_trace_router(lambda: engine.tracer))

- `GET /v1/trace/{request_id}?format=chrome|mechanism`: one request's trace as Chrome trace-event JSON
  (open it in Perfetto) or as a mechanism-diagram scenario; an API response id resolves to its first
  prompt's request. 404 (OpenAI-style error body) for an id the tracer does not hold.
- `GET /v1/trace?format=chrome`: everything recent (engine loop and every traced request).
- `GET /v1/dashboard/state`: the JSON snapshot the dashboard polls.
- `GET /dashboard`: the dashboard page (static HTML, JS and CSS from this package; no CDN, no build step).

Handlers are plain functions, so FastAPI runs them on its thread pool: snapshots copy under the tracer's
lock and never block the event loop.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from importlib import resources
from typing import Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse, JSONResponse, Response

from tokenloop.observe.tracer import Tracer
from tokenloop.serving.errors import clipped

TraceFormat = Literal["chrome", "mechanism"]

_EXPORT_TTL_S = 1.0
_EXPORT_DUTY = 4.0
_STATIC = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}


def _error(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    # The OpenAI error shape the rest of the API uses, built here so the router works in any app.
    body = {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _encode_yielding(value: object) -> bytes:
    """JSON of a large export, in pieces: `json.dumps` encodes in one C call that holds the GIL throughout
    (a multi-megabyte trace stalled the engine thread for most of a second); the chunked encoder lets the
    interpreter switch threads between pieces, so the engine keeps stepping while an export is written."""
    return "".join(_CHUNKED_ENCODER.iterencode(value)).encode()


_CHUNKED_ENCODER = json.JSONEncoder()


def _static(name: str) -> str:
    return resources.files("tokenloop.serving").joinpath("static", name).read_text(encoding="utf-8")


def make_trace_router(get_tracer: Callable[[], Tracer | None]) -> APIRouter:
    """Routes for traces and the dashboard; `get_tracer` returns the engine's tracer (None: tracing off)."""
    router = APIRouter()

    def tracer_or_error() -> Tracer | JSONResponse:
        tracer = get_tracer()
        if tracer is None:
            return _error(404, "tracing is off on this server: start the engine with a Tracer", "tracing_disabled")
        return tracer

    @router.get("/v1/trace/{request_id}")
    def get_trace(request_id: str, format: TraceFormat = Query("chrome")) -> Response:  # `format`: the API's name
        tracer = tracer_or_error()
        return tracer if isinstance(tracer, JSONResponse) else _request_trace(tracer, request_id, format)

    recent = _RecentExport()

    @router.get("/v1/trace")
    def get_all_traces(format: Literal["chrome"] = Query("chrome")) -> Response:
        tracer = tracer_or_error()
        if isinstance(tracer, JSONResponse):
            return tracer
        return Response(recent.body(tracer, format), media_type="application/json")

    @router.get("/v1/dashboard/state")
    def dashboard_state() -> Response:
        tracer = tracer_or_error()
        if isinstance(tracer, JSONResponse):
            return tracer
        return JSONResponse(tracer.dashboard_state(), headers={"Cache-Control": "no-store"})

    @router.get("/dashboard", response_class=HTMLResponse)
    def dashboard() -> Response:
        return HTMLResponse(_static("dashboard.html"), headers={"Cache-Control": "no-store"})

    @router.get("/dashboard/{name}")
    def dashboard_asset(name: str) -> Response:
        media_type = _STATIC.get(name)
        if media_type is None:  # a fixed list: nothing else of the package is reachable
            return _error(404, f"no dashboard file {clipped(name)!r}", "not_found")
        return Response(_static(name), media_type=media_type, headers={"Cache-Control": "no-store"})

    return router


def _request_trace(tracer: Tracer, request_id: str, format: TraceFormat) -> Response:
    """One request's trace in `format`, or a 404 naming why there is none."""
    resolved = tracer.resolve(request_id)
    if resolved is None:
        return _error(404, f"no trace for request {clipped(request_id)!r}: unknown, not sampled, or "
                      f"evicted from the tracer's buffer of {tracer.max_requests} recent requests",
                      "trace_not_found", "request_id")
    try:
        body: dict[str, Any] = (tracer.chrome_trace(resolved) if format == "chrome"
                                else tracer.mechanism(resolved))
    except KeyError:  # evicted between resolve and export
        return _error(404, f"no trace for request {clipped(request_id)!r}", "trace_not_found",
                      "request_id")
    return JSONResponse(body)


class _RecentExport:
    """The export of everything recent, shared by the clients polling it.

    It costs ~0.2-1 s of Python (GIL time the engine thread then waits for): one build is reused for
    `_EXPORT_TTL_S` or _EXPORT_DUTY x its build time, whichever is longer, so exports never take more than
    ~1/_EXPORT_DUTY of the interpreter.
    """

    def __init__(self) -> None:
        self._cached: dict[str, tuple[float, bytes]] = {}  # format -> (reusable until, body)
        self._lock = threading.Lock()

    def body(self, tracer: Tracer, format: str) -> bytes:
        with self._lock:  # one build at a time; the others wait for it and share it
            built = self._cached.get(format)
            now = time.monotonic()
            if built is None or now > built[0]:
                body = _encode_yielding(tracer.chrome_trace())
                done = time.monotonic()
                built = self._cached[format] = (done + max(_EXPORT_TTL_S, _EXPORT_DUTY * (done - now)), body)
            return built[1]
