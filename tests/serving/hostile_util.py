"""Helpers for the hardening tests (issue 9): a keyed, traced tiny-model server, raw HTTP, error checks.

The server is the in-process one of `tests/serving/conftest.py` (real uvicorn on 127.0.0.1, free port),
built like `tokenloop serve --api-key KEY --max-waiting 8 --policy priority` with every request traced,
so that the trace and dashboard routes hold request data worth protecting.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from tests.serving.conftest import MODEL, LiveServer, metric_value
from tokenloop.engine import LLMEngine
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint
from tokenloop.observe.tracer import Tracer
from tokenloop.serving.app import create_app
from tokenloop.serving.server import ServerThread

KEY = "hostile-suite-key-9"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON_HEADERS = {"Content-Type": "application/json"}
MAX_WAITING = 8
MAX_MODEL_LEN = 1024  # the tiny model's positions (512 blocks x 4 tokens hold more)


@contextmanager
def keyed_server(checkpoint: Checkpoint, *, api_key: str | None = KEY, max_waiting: int = MAX_WAITING,
                 policy: str = "priority", app_options: dict[str, Any] | None = None,
                 **options: Any) -> Iterator[LiveServer]:
    """A traced tiny-model server behind `api_key`; its client sends no key unless told."""
    options.setdefault("max_num_seqs", 16)
    options.setdefault("max_num_batched_tokens", 256)
    options.setdefault("block_size", 4)
    options.setdefault("num_blocks", 512)
    config = build_engine_config(str(checkpoint.path), max_waiting=max_waiting, policy=policy, **options)
    engine = LLMEngine(config, checkpoint=checkpoint, tracer=Tracer(sample_rate=1.0))
    app = create_app(engine, served_model_name=MODEL, api_key=api_key, shutdown_timeout_s=1.0,
                     **(app_options or {}))
    with ServerThread(app, shutdown_timeout_s=1.0) as thread, \
            httpx.Client(base_url=thread.url, timeout=60.0) as client:
        yield LiveServer(thread, client, engine, app.state.async_engine)


def dumps(body: Any) -> bytes:
    """JSON text as a hostile client writes it: lone surrogates as `\\udXXX` escapes, NaN/Infinity bare."""
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode("ascii")


def post_raw(client: httpx.Client, path: str, content: bytes, *, headers: dict[str, str] | None = None,
             timeout: float = 60.0) -> httpx.Response:
    return client.post(path, content=content, headers={**JSON_HEADERS, **AUTH, **(headers or {})},
                       timeout=timeout)


# ---- error bodies -------------------------------------------------------------------------------------

# What a client must never read in an error message: validator dumps, exception names, tracebacks.
_BANNED = ("(and ", "more error", "[type=", "errors.pydantic.dev", "For further information",
           "validation error", "Traceback", "function-after", "pydantic", "UnicodeEncodeError",
           "UnicodeDecodeError", "RecursionError", "OverflowError", "ValueError", "TypeError", "KeyError",
           "AttributeError", "RuntimeError", "IndexError", "internal error:", "Exception", "\\ud8", "\\udc")


def leaf_name(param: str) -> str:
    """`messages[0].content[1]` -> `content`."""
    return re.findall(r"[A-Za-z_]+", param)[-1]


def param_matches(actual: str | None, expected: str | tuple[str, ...] | None) -> bool:
    """`expected` or a sub-path of it (`stop` accepts `stop[1]`); a tuple lists alternatives."""
    if isinstance(expected, tuple):
        return any(param_matches(actual, e) for e in expected)
    if expected is None or actual is None:
        return actual == expected
    return actual == expected or actual.startswith((expected + "[", expected + "."))


def assert_clean_message(message: Any, *, names: str | None = None) -> None:
    """One clear sentence: a short single-line string, no dumps, no exception text; names `names` if given."""
    assert isinstance(message, str) and message.strip(), f"empty message: {message!r}"
    assert "\n" not in message, f"multi-line message: {message!r}"
    assert len(message) <= 400, f"message too long ({len(message)} chars): {message[:200]!r}..."
    for banned in _BANNED:
        assert banned not in message, f"message contains {banned!r}: {message!r}"
    if names is not None:
        assert names.lower() in message.lower(), f"message does not name {names!r}: {message!r}"


def assert_error(response: httpx.Response, status: int | tuple[int, ...], *, param: Any = ...,
                 code: Any = ..., type_: str | None = None, names_field: bool = True) -> dict[str, Any]:
    """The OpenAI error body: `{"error": {"message", "type", "param", "code"}}` with the given fields.

    `param=...` leaves param unchecked; otherwise see `param_matches`. With `names_field`, the message
    names the leaf of the param it reports.
    """
    statuses = status if isinstance(status, tuple) else (status,)
    assert response.status_code in statuses, (
        f"status {response.status_code}, wanted {status}: {response.text[:600]}")
    assert response.headers.get("content-type", "").startswith("application/json"), response.headers
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    if type_ is None:
        type_ = "invalid_request_error" if response.status_code < 500 else "server_error"
    assert error["type"] == type_, error
    if param is not ...:
        assert param_matches(error["param"], param), f"param {error['param']!r}, wanted {param!r}: {error}"
    if code is not ...:
        assert error["code"] == code, f"code {error['code']!r}, wanted {code!r}: {error}"
    names = leaf_name(error["param"]) if names_field and error["param"] else None
    assert_clean_message(error["message"], names=names)
    return error


def assert_not_500(response: httpx.Response) -> None:
    assert response.status_code < 500 or response.status_code == 503, (
        f"server error {response.status_code}: {response.text[:600]}")


# ---- the server is fine afterwards -------------------------------------------------------------------

def engine_quiet(live: LiveServer, timeout_s: float = 15.0) -> None:
    """/health answers 200; nothing runs or waits; no KV block is referenced; the pool is consistent."""
    r = live.client.get("/health", timeout=10.0)
    assert r.status_code == 200, f"/health answered {r.status_code}: {r.text[:300]}"
    live.wait_idle(timeout_s=timeout_s)
    live.on_engine(lambda e: e.kv_cache.check_invariants([]))  # no table left, refcounts all 0
    assert live.async_engine.num_live_requests == 0
    metrics = live.client.get("/metrics", timeout=10.0).text
    assert metric_value(metrics, "tokenloop:num_requests_running") == 0
    assert metric_value(metrics, "tokenloop:num_requests_waiting") == 0
    assert metric_value(metrics, "tokenloop:kv_cache_usage_perc") == 0.0


def healthy(live: LiveServer) -> bool:
    try:
        return live.client.get("/health", timeout=5.0).status_code == 200 and live.async_engine.is_running
    except httpx.HTTPError:
        return False


# ---- raw sockets: requests httpx will not send (a body that never comes, a declared size) -------------

def raw_exchange(url: str, head: str, body_chunks: Iterator[bytes] | None = None, *,
                 timeout_s: float = 10.0) -> tuple[int | None, dict[str, str], bytes, float]:
    """Send `head` (request line + headers, CRLF-terminated) and body chunks until the server answers.

    Returns (status or None on timeout/close, headers, body, seconds until the status line). Body chunks
    stop as soon as the server has written something, as a real client would notice an early answer.
    """
    host, port = url.removeprefix("http://").split(":")
    begin = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(head.encode("latin-1"))
        received = b""
        if body_chunks is not None:
            sock.setblocking(False)
            for chunk in body_chunks:
                try:
                    received += sock.recv(65536)
                    if received:
                        break
                except BlockingIOError:
                    pass
                view = memoryview(chunk)
                while view:
                    try:
                        sent = sock.send(view)
                        view = view[sent:]
                    except BlockingIOError:
                        time.sleep(0.001)
                        try:
                            received += sock.recv(65536)
                        except BlockingIOError:
                            pass
                        if received:
                            break
                    except (BrokenPipeError, ConnectionResetError):
                        break
                if received or time.monotonic() - begin > timeout_s:
                    break
            sock.setblocking(True)
        sock.settimeout(max(0.1, timeout_s - (time.monotonic() - begin)))
        try:
            while b"\r\n\r\n" not in received:
                data = sock.recv(65536)
                if not data:
                    break
                received += data
        except (TimeoutError, ConnectionResetError):
            pass
        elapsed = time.monotonic() - begin
        head_bytes, _, rest = received.partition(b"\r\n\r\n")
        if not head_bytes.startswith(b"HTTP/"):
            return None, {}, received, elapsed
        lines = head_bytes.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0") or 0)
        try:
            while len(rest) < length:
                data = sock.recv(65536)
                if not data:
                    break
                rest += data
        except (TimeoutError, ConnectionResetError):
            pass
        return status, headers, rest, elapsed


def raw_error(status: int | None, headers: dict[str, str], body: bytes) -> dict[str, Any]:
    """The OpenAI error object of a raw response (asserting its shape)."""
    assert status is not None, f"no answer (timeout or connection closed): {body[:200]!r}"
    assert headers.get("content-type", "").startswith("application/json"), (status, headers, body[:300])
    parsed = json.loads(body)
    assert set(parsed) == {"error"} and set(parsed["error"]) == {"message", "type", "param", "code"}, parsed
    assert_clean_message(parsed["error"]["message"])
    return parsed["error"]
