"""The `bench serve` client against fake SSE servers: parsing, timing and the printed/saved results."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tokenloop.bench.cli import main
from tokenloop.bench.metrics import compute_metrics
from tokenloop.bench.serve import ClientConfig, request_body, run_requests, send_offsets
from tokenloop.bench.trace import TraceRequest


class FakeClock:
    """Seconds that move only when the fake server says so."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def frame(obj: dict[str, Any] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def completion_chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text,
                                                                       "finish_reason": finish}]}


def usage_chunk(prompt: int, completion: int) -> dict[str, Any]:
    return {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                                     "total_tokens": prompt + completion}}


class ScriptedServer:
    """A MockTransport handler: per request, a list of (delay_s, frame) played on the fake clock."""

    def __init__(self, clock: FakeClock, scripts: list[list[tuple[float, bytes]]], status: int = 200) -> None:
        self.clock = clock
        self.scripts = list(scripts)
        self.status = status
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        script = self.scripts.pop(0)
        clock = self.clock

        async def stream() -> AsyncIterator[bytes]:
            for delay, data in script:
                clock.t += delay  # the chunk 'arrives' delay seconds after the previous one
                yield data

        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "overloaded"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Stream(stream()))


class _Stream(httpx.AsyncByteStream):
    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.chunks:
            yield chunk

    async def aclose(self) -> None:
        await self.chunks.aclose()  # type: ignore[attr-defined]


def _requests(n: int, max_tokens: int = 4) -> list[TraceRequest]:
    return [TraceRequest(id=f"q{i}", arrival_s=0.0, max_tokens=max_tokens, prompt_tokens=(11, 12, 13),
                         user="u" if i == 0 else None, priority=2 if i == 0 else 0) for i in range(n)]


def _run(server: ScriptedServer, requests: list[TraceRequest], config: ClientConfig, clock: FakeClock):
    return asyncio.run(run_requests(requests, [0.0] * len(requests), config, clock=clock,
                                    transport=httpx.MockTransport(server), progress=False))


def test_stream_timing_and_metrics_match_hand_computed_values() -> None:
    clock = FakeClock()
    scripts = [
        # 4 tokens in 4 chunks: TTFT 0.1, gaps 0.02, 0.03, 0.05 -> E2EL 0.2; usage after the last text.
        [(0.1, frame(completion_chunk("a"))), (0.02, frame(completion_chunk("b"))),
         (0.03, frame(completion_chunk("c"))), (0.05, frame(completion_chunk("d", "length"))),
         (0.5, frame(usage_chunk(10, 4))), (0.0, frame("[DONE]"))],
        # 3 tokens, the last two in one chunk; a finish-only chunk with no text is not a token.
        [(0.05, frame(completion_chunk("x"))), (0.1, frame(completion_chunk("yz"))),
         (0.2, frame(completion_chunk("", "length"))), (0.0, frame(usage_chunk(5, 3))), (0.0, frame("[DONE]"))],
    ]
    server = ScriptedServer(clock, scripts)
    records, duration = _run(server, _requests(2), ClientConfig("http://fake", max_concurrency=1), clock)
    first, second = records
    assert first.success and second.success
    assert first.ttft_s == pytest.approx(0.1)
    assert first.itls_s == pytest.approx([0.02, 0.03, 0.05])
    assert first.e2el_s == pytest.approx(0.2)  # the last text chunk, not the usage chunk
    assert (first.prompt_len, first.output_len, first.generated_text) == (10, 4, "abcd")
    assert second.itls_s == pytest.approx([0.1])
    assert (second.output_len, second.e2el_s, second.tpot_s) == (3, pytest.approx(0.15), pytest.approx(0.05))
    assert duration == pytest.approx(0.7 + 0.35)

    m = compute_metrics(records, duration, slos_ms={"tpot": 40.0})
    assert m.ttft.mean_ms == pytest.approx(75.0)
    assert m.itl.mean_ms == pytest.approx((20 + 30 + 50 + 100) / 4)  # pooled chunk gaps
    assert m.tpot.mean_ms == pytest.approx((100 / 3 + 50) / 2)
    assert m.request_goodput == pytest.approx(1 / 1.05)  # only the first meets TPOT <= 40 ms
    assert (m.total_input, m.total_output) == (15, 7)

    body = server.bodies[0]
    assert body["prompt"] == [11, 12, 13] and body["max_tokens"] == 4
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["priority"] == 2 and body["user"] == "u"
    assert "priority" not in server.bodies[1] and "user" not in server.bodies[1]


def test_chat_role_chunk_is_not_the_first_token() -> None:
    clock = FakeClock()

    def chat(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return frame({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta,
                                                                      "finish_reason": finish}]})

    script = [(0.01, chat({"role": "assistant", "content": ""})), (0.3, chat({"content": "Hi"})),
              (0.1, chat({"content": "!"})), (0.0, chat({}, "length")), (0.0, frame(usage_chunk(7, 2))),
              (0.0, frame("[DONE]"))]
    server = ScriptedServer(clock, [script])
    request = TraceRequest(id="c", arrival_s=0.0, max_tokens=2, prompt="Hello")
    [record], _ = _run(server, [request], ClientConfig("http://fake", endpoint="/v1/chat/completions"), clock)
    assert record.success and record.ttft_s == pytest.approx(0.31) and record.itls_s == pytest.approx([0.1])
    assert server.bodies[0]["messages"] == [{"role": "user", "content": "Hello"}]
    assert server.bodies[0]["max_completion_tokens"] == 2


@pytest.mark.parametrize(("script", "status", "error"), [
    ([(0.1, frame(completion_chunk("a"))), (0.0, frame({"error": {"message": "engine failed"}})),
      (0.0, frame("[DONE]"))], 200, "engine failed"),
    ([(0.1, frame(completion_chunk("a")))], 200, "without [DONE]"),
    ([(0.0, frame(usage_chunk(3, 0))), (0.0, frame("[DONE]"))], 200, "no token"),
    ([], 503, "HTTP 503"),
])
def test_failures_are_recorded_not_raised(script: list, status: int, error: str) -> None:
    clock = FakeClock()
    [record], _ = _run(ScriptedServer(clock, [script], status), _requests(1), ClientConfig("http://fake"), clock)
    assert not record.success and error in record.error


def test_gamma_arrivals() -> None:
    assert send_offsets(5, float("inf")) == [0.0] * 5
    offsets = send_offsets(4000, request_rate=8.0, burstiness=0.5, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert np.mean(gaps) == pytest.approx(1 / 8, rel=0.1)
    # Gamma(k, theta): variance k * theta^2 = 1 / (rate^2 * k): burstiness 0.5 doubles Poisson's variance.
    assert np.var(gaps) == pytest.approx(1 / (64 * 0.5), rel=0.2)
    assert send_offsets(10, 8.0, 0.5, seed=1) == send_offsets(10, 8.0, 0.5, seed=1)


def test_max_concurrency_limits_requests_in_flight() -> None:
    in_flight, peak = 0, 0

    async def stream() -> AsyncIterator[bytes]:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await asyncio.sleep(0.01)
            yield frame(completion_chunk("a")) + frame(usage_chunk(3, 1)) + frame("[DONE]")
        finally:  # the client stops reading at [DONE] and closes the response
            in_flight -= 1

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_Stream(stream()))

    records, _ = asyncio.run(run_requests(_requests(8, 1), [0.0] * 8, ClientConfig("http://fake", max_concurrency=3),
                                          transport=httpx.MockTransport(handler), progress=False))
    assert all(r.success for r in records) and peak == 3


def test_chat_needs_text_prompts() -> None:
    with pytest.raises(ValueError, match="text prompt"):
        request_body(_requests(1)[0], ClientConfig("http://x", endpoint="/v1/chat/completions"))


# ---- a real socket: the whole command against a tiny SSE app ------------------------------------

def _sse_app(received: list[dict[str, Any]]):  # a Starlette app
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        received.append(body)

        async def frames() -> AsyncIterator[bytes]:
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.005)
                yield frame(completion_chunk(f"t{i} ", "length" if i == body["max_tokens"] - 1 else None))
            yield frame(usage_chunk(len(body["prompt"]), body["max_tokens"]))
            yield frame("[DONE]")

        return StreamingResponse(frames(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@contextmanager
def serving(app: Any) -> Iterator[str]:
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_bench_serve_command_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    received: list[dict[str, Any]] = []
    with serving(_sse_app(received)) as url:
        code = main(["serve", "--base-url", url, "--dataset", "random", "--num-prompts", "6",
                     "--random-input-len", "8", "--random-output-len", "4", "--random-range-ratio", "0.5",
                     "--request-rate", "200", "--burstiness", "2", "--max-concurrency", "4", "--seed", "3",
                     "--goodput", "ttft:5000", "e2el:5000", "--save-result", str(tmp_path / "r.json"),
                     "--disable-tqdm"])
    assert code == 0
    out = capsys.readouterr().out
    for line in ("Traffic request rate: 200.0", "Burstiness factor: 2.0 (Gamma distribution)",
                 "Maximum request concurrency: 4", "Successful requests:                     6",
                 "Failed requests:                         0", "Request goodput (req/s):", "P99 E2EL (ms):"):
        assert line in out, line
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 6 and saved["endpoint_type"] == "openai" and saved["max_concurrency"] == 4
    # Output lengths are as asked (ignore_eos + max_tokens); the server's usage is what is counted.
    # (The server may see concurrent requests in another order than they were sent: compare as sets.)
    assert sorted(zip(saved["input_lens"], saved["output_lens"])) == \
        sorted((len(body["prompt"]), body["max_tokens"]) for body in received)
    assert all(2 <= n <= 6 for n in saved["output_lens"])
    assert [len(itls) for itls in saved["itls"]] == [n - 1 for n in saved["output_lens"]]
    assert all(t > 0 for t in saved["ttfts"]) and all(e >= t for e, t in zip(saved["e2els"], saved["ttfts"]))
    assert saved["request_goodput"] == pytest.approx(saved["request_throughput"])
    assert all(body["ignore_eos"] and body["stream_options"]["include_usage"] for body in received)
