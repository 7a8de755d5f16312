"""Issue 34, item 2: connections are not requests.

Idle sockets (no request head, or between keep-alive requests) cost a file descriptor and are closed after
the header-read timeout, or sooner when the connection budget is full and a newcomer needs the room;
requests in flight are what the 503 limit counts, in OpenAI's error shape. A request the HTTP parser
rejects gets OpenAI's error body too. Each test runs a real uvicorn server on 127.0.0.1 (tiny model).
"""

from __future__ import annotations

import json
import resource
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.serving.conftest import MODEL, LiveServer, slow_steps
from tests.serving.hostile_util import AUTH, dumps, engine_quiet, keyed_server, raw_error
from tokenloop.config import ServerLimits
from tokenloop.model.loader import Checkpoint
from tokenloop.serving.connections import FD_RESERVE, connection_budget, raise_open_file_limit

# Generous for a loaded 2-core machine: the point is an answer, not a refusal or a hang.
ANSWER_BOUND_S = 10.0


def _address(live: LiveServer) -> tuple[str, int]:
    host, port = live.url.removeprefix("http://").split(":")
    return host, int(port)


def _open_idle(live: LiveServer, count: int, partial_head: bool = False) -> list[socket.socket]:
    """`count` connections that never complete a request head (some send half of one)."""
    sockets = []
    for i in range(count):
        sock = socket.create_connection(_address(live), timeout=10.0)
        if partial_head and i % 2:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sockets.append(sock)
    return sockets


def _closed_by_server(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the server closes `sock` (EOF or reset) within `timeout_s`."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        sock.setblocking(True)


def _close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


@pytest.fixture(scope="module")
def idle_server(tiny_checkpoint: Checkpoint) -> Iterator[LiveServer]:
    """At most 4 requests in flight; a 1 s header-read timeout."""
    limits = ServerLimits(max_concurrent_requests=4, header_read_timeout_s=1.0)
    with keyed_server(tiny_checkpoint, app_options={"limits": limits}) as live:
        yield live


def test_many_idle_connections_lock_nobody_out(idle_server: LiveServer) -> None:
    """300 idle sockets (75x the request limit, above the old 256-connection default): /health, /v1/models
    and a real completion are answered, and no idle socket had to be evicted to make room."""
    idle = _open_idle(idle_server, 300, partial_head=True)
    try:
        with httpx.Client(base_url=idle_server.url, timeout=ANSWER_BOUND_S) as client:
            begin = time.monotonic()
            assert client.get("/health").status_code == 200
            assert client.get("/v1/models", headers=AUTH).status_code == 200
            r = client.post("/v1/completions", headers=AUTH,
                            json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0.0})
            assert r.status_code == 200, r.text[:300]
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            assert time.monotonic() - begin < ANSWER_BOUND_S
        assert idle_server.thread.server.connection_table.evicted == 0
    finally:
        _close_all(idle)
    engine_quiet(idle_server)


def test_idle_connections_close_after_the_header_timeout(idle_server: LiveServer) -> None:
    """Idle sockets, with or without half a head, are closed ~1 s (the header-read timeout) after opening."""
    begin = time.monotonic()
    idle = _open_idle(idle_server, 40, partial_head=True)
    try:
        assert all(_closed_by_server(sock, timeout_s=10.0) for sock in idle), "an idle socket stayed open"
        elapsed = time.monotonic() - begin
        assert 0.9 <= elapsed < 8.0, f"closed after {elapsed:.2f} s, wanted about the 1 s timeout"
    finally:
        _close_all(idle)


def test_keep_alive_connections_are_idle_between_requests(idle_server: LiveServer) -> None:
    """Six clients keep their connections open after a request each (more than the limit of 4 requests
    in flight): between requests they are idle, and every client is served again."""
    clients = [httpx.Client(base_url=idle_server.url, timeout=ANSWER_BOUND_S) for _ in range(6)]
    try:
        for _ in range(2):
            for client in clients:
                assert client.get("/v1/models", headers=AUTH).status_code == 200
    finally:
        for client in clients:
            client.close()


def test_requests_in_flight_are_limited_with_an_openai_503(idle_server: LiveServer) -> None:
    """Four streams in flight (held by slow steps): a fifth request is 503 with Retry-After in OpenAI's
    shape; /health still answers; once the streams end, requests are served again."""
    body = dumps({"model": MODEL, "prompt": "hold", "max_tokens": 400, "ignore_eos": True, "stream": True})
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {AUTH['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    streams: list[socket.socket] = []
    with slow_steps(idle_server.async_engine):
        try:
            for _ in range(4):
                sock = socket.create_connection(_address(idle_server), timeout=10.0)
                sock.sendall(head + body)
                streams.append(sock)
            deadline = time.monotonic() + 30.0
            while idle_server.on_engine(lambda e: e.num_unfinished_requests) < 4:
                assert time.monotonic() < deadline, "the streams never started"
                time.sleep(0.02)
            with httpx.Client(base_url=idle_server.url, timeout=ANSWER_BOUND_S) as client:
                r = client.get("/v1/models", headers=AUTH)
                assert r.status_code == 503, r.text[:300]
                assert r.headers.get("retry-after") == "1"
                error = raw_error(r.status_code, dict(r.headers), r.content)
                assert error["code"] == "server_overloaded" and error["type"] == "server_error"
                assert client.get("/health").status_code == 200
        finally:
            _close_all(streams)
    deadline = time.monotonic() + 30.0
    with httpx.Client(base_url=idle_server.url, timeout=ANSWER_BOUND_S) as client:
        while client.get("/v1/models", headers=AUTH).status_code != 200:
            assert time.monotonic() < deadline, "still refused after the streams closed"
            time.sleep(0.05)
    engine_quiet(idle_server)


def test_a_full_connection_budget_evicts_the_oldest_idle_connection(tiny_checkpoint: Checkpoint) -> None:
    """With room for 16 connections, 20 idle ones: the oldest are closed to let newcomers in, and a
    newcomer's request (/health) is answered."""
    limits = ServerLimits(max_connections=16)
    with keyed_server(tiny_checkpoint, app_options={"limits": limits}) as live:
        table = live.thread.server.connection_table
        assert table.max_connections == 16
        first = _open_idle(live, 16)
        deadline = time.monotonic() + 10.0
        while len(table.idle) < 16:
            assert time.monotonic() < deadline, f"only {len(table.idle)} connections were accepted"
            time.sleep(0.01)
        later = _open_idle(live, 4)
        try:
            assert all(_closed_by_server(sock, timeout_s=10.0) for sock in first[:4]), "no eviction"
            with httpx.Client(base_url=live.url, timeout=ANSWER_BOUND_S) as client:
                assert client.get("/health").status_code == 200
            assert all(_still_open(sock) for sock in later), "a newer connection was evicted first"
            assert table.evicted >= 5  # four for `later`, one (at least) for the client's
        finally:
            _close_all(first + later)


# ---- requests the HTTP parser rejects ----------------------------------------------------------------

def _raw(live: LiveServer, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes; the whole response (the server closes the connection after a parse error)."""
    with socket.create_connection(_address(live), timeout=10.0) as sock:
        sock.sendall(data)
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, body


MALFORMED = [
    ("garbage-request-line", b"GARBAGE\r\n\r\n", 400),
    ("content-length-word", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
    ("content-length-twice", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
                             b"Content-Length: 2\r\n\r\nab", 400),
    ("header-without-colon", b"GET /health HTTP/1.1\r\nHost: x\r\nnot a header\r\n\r\n", 400),
    ("no-host", b"GET /health HTTP/1.1\r\n\r\n", 400),
    ("bad-chunk-size", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    # A head past h11's 16 KiB that has not ended yet (a whole one in one read is parsed as it is).
    ("head-too-large", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000, 431),
]


@pytest.mark.parametrize(("data", "status"), [(d, s) for _, d, s in MALFORMED], ids=[i for i, _, _ in MALFORMED])
def test_malformed_http_gets_the_openai_error_shape(idle_server: LiveServer, data: bytes, status: int) -> None:
    got, headers, body = _raw(idle_server, data)
    assert got == status, (got, body[:300])
    error = raw_error(got, headers, body)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http_request", error
    assert json.loads(body)["error"]["message"].startswith("the HTTP request is malformed")


def test_websocket_upgrade_is_served_as_plain_http(idle_server: LiveServer) -> None:
    got, _, _ = _raw(idle_server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, close\r\n"
                                  b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                                  b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    assert got == 200


# ---- the open-file budget ----------------------------------------------------------------------------

def test_open_file_limit_is_raised_and_bounds_the_budget() -> None:
    soft, hard = raise_open_file_limit()
    assert (soft, hard) == resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard or hard == resource.RLIM_INFINITY
    budget = connection_budget(ServerLimits())
    if soft != resource.RLIM_INFINITY:
        assert budget == min(ServerLimits().max_connections, soft - FD_RESERVE)
    assert connection_budget(ServerLimits(max_connections=10)) == 10
