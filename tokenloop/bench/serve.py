"""`bench serve`: an async load generator for an OpenAI-compatible server, measured as `vllm bench serve`.

Requests are sent on a schedule of Gamma-distributed gaps (shape = burstiness, scale = 1 / (rate x
burstiness), so the mean rate is `rate` and burstiness 1 is a Poisson process; rate inf sends all at
once), optionally capped at `max_concurrency` in flight. Each request streams (SSE) with
`ignore_eos` and `max_tokens`, so output lengths are exactly as asked, and asks for usage in the last
chunk, whose token counts are authoritative. A trace's own arrival times replace the Gamma schedule.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import numpy as np
from tqdm.auto import tqdm

from tokenloop.bench.metrics import RequestRecord
from tokenloop.bench.trace import TraceRequest

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# One long generation on a CPU may take minutes; a benchmark should wait rather than count it failed.
DEFAULT_REQUEST_TIMEOUT_S = 6 * 60 * 60.0


@dataclass(frozen=True)
class ClientConfig:
    """Where to send requests and what every request asks for."""

    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    max_concurrency: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unsupported endpoint {self.endpoint!r} (supported: {', '.join(ENDPOINTS)})")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")

    @property
    def chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


def send_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds from the start: 0, then cumulative Gamma gaps."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    if math.isinf(request_rate) or num_requests <= 1:
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def request_body(request: TraceRequest, config: ClientConfig) -> dict[str, Any]:
    """The JSON body of one streaming request."""
    body: dict[str, Any] = {}
    if config.model is not None:
        body["model"] = config.model
    if config.chat:
        if request.prompt is None:
            raise ValueError(f"request {request.id}: the chat endpoint needs a text prompt")
        body["messages"] = [{"role": "user", "content": request.prompt}]
        body["max_completion_tokens"] = request.max_tokens
    else:
        body["prompt"] = request.prompt_input
        body["max_tokens"] = request.max_tokens
    body.update(temperature=config.temperature, stream=True, stream_options={"include_usage": True},
                ignore_eos=config.ignore_eos)
    # Sent only when set: a server without priority scheduling may refuse a non-zero priority.
    if request.priority:
        body["priority"] = request.priority
    if request.user is not None:
        body["user"] = request.user
    body.update(config.extra_body)
    return body


def _chunk_text(data: dict[str, Any], chat: bool) -> str:
    choices = data.get("choices") or []
    if not choices:
        return ""
    if chat:
        delta = choices[0].get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choices[0].get("text") or ""


async def _sse_data(response: httpx.Response) -> AsyncIterator[dict[str, Any] | None]:
    """Each server-sent `data:` event's JSON, then None at `[DONE]` (keep-alives and comments skipped)."""
    async for line in response.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue  # empty, keep-alive or comment
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            yield None
            return
        yield json.loads(payload)


async def send_request(client: httpx.AsyncClient, request: TraceRequest, config: ClientConfig, *,
                       clock: Callable[[], float] = time.perf_counter, start_s: float = 0.0) -> RequestRecord:
    """Stream one request and time it: TTFT at the first chunk with text, ITLs between such chunks.

    Chunks without text (the chat role chunk, a finish-only chunk, the usage chunk) carry no token and
    are not timed; a chunk may carry several tokens, and the usage chunk says how many there were.
    """
    record = RequestRecord(success=False, prompt_len=request.prompt_len_hint, request_id=request.id,
                           priority=request.priority, user=request.user, start_s=start_s)
    body = request_body(request, config)
    text_parts: list[str] = []
    num_chunks = 0
    usage_output: int | None = None
    sent = clock()
    last = sent
    done = False
    try:
        async with client.stream("POST", config.url, json=body, timeout=config.request_timeout_s) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status_code}: {detail[:500]}"
                return record
            async for data in _sse_data(response):
                if data is None:
                    done = True
                    break
                if "error" in data:
                    error = data["error"]
                    record.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
                    return record
                now = clock()
                text = _chunk_text(data, config.chat)
                if text:
                    if num_chunks == 0:
                        record.ttft_s = now - sent
                    else:
                        record.itls_s.append(now - last)
                    last = now
                    num_chunks += 1
                    text_parts.append(text)
                usage = data.get("usage")
                if usage:
                    usage_output = usage.get("completion_tokens")
                    if usage.get("prompt_tokens"):
                        record.prompt_len = usage["prompt_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    if not done:
        record.error = "the stream ended without [DONE]"
        return record
    if num_chunks == 0:
        record.error = "the stream carried no token"
        return record
    record.e2el_s = last - sent
    record.output_len = usage_output if usage_output is not None else num_chunks
    record.generated_text = "".join(text_parts)
    record.success = True
    return record


async def run_requests(requests: Sequence[TraceRequest], offsets_s: Sequence[float], config: ClientConfig, *,
                       clock: Callable[[], float] = time.perf_counter,
                       transport: httpx.AsyncBaseTransport | None = None, progress: bool = True,
                       desc: str = "requests") -> tuple[list[RequestRecord], float]:
    """Send each request at its offset from the start (at most `max_concurrency` in flight).

    Returns the records in request order and the benchmark duration: first send to last completion.
    """
    if len(offsets_s) != len(requests):
        raise ValueError("one send offset per request is needed")
    limit = config.max_concurrency
    limits = httpx.Limits(max_connections=limit or len(requests) or 1, max_keepalive_connections=limit or 100)
    semaphore = asyncio.Semaphore(limit) if limit else None
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not progress, dynamic_ncols=True)

    async with httpx.AsyncClient(timeout=config.request_timeout_s, limits=limits, transport=transport) as client:
        start = clock()

        async def one(request: TraceRequest) -> RequestRecord:
            if semaphore is None:
                record = await send_request(client, request, config, clock=clock, start_s=clock() - start)
            else:
                async with semaphore:  # as in vLLM: the wait for a slot is not part of the request's latency
                    record = await send_request(client, request, config, clock=clock, start_s=clock() - start)
            bar.update(1)
            return record

        tasks = []
        for request, offset in zip(requests, offsets_s):
            delay = start + offset - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        records = list(await asyncio.gather(*tasks))
        duration = clock() - start
    bar.close()
    return records, duration


def serve_metadata(config: ClientConfig, *, dataset: str, num_prompts: int, request_rate: float,
                   burstiness: float) -> dict[str, Any]:
    """The run's settings, saved beside the results under vLLM's names."""
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai-chat" if config.chat else "openai",
        "base_url": config.base_url,
        "endpoint": config.endpoint,
        "model_id": config.model,
        "dataset": dataset,
        "num_prompts": num_prompts,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "burstiness": burstiness,
        "max_concurrency": config.max_concurrency,
    }
