"""What the front end hands its callers: one async stream of `RequestOutput`s per submission.

The engine thread puts outputs into a stream with `loop.call_soon_threadsafe` (one callback per step and
event loop, `deliver`); the stream's reader iterates it on its own loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tokenloop.errors import RequestFailedError
from tokenloop.outputs import CompletionOutput, RequestOutput
from tokenloop.request import FinishReason, SamplingParams


class Aborts(Protocol):
    """What a stream needs of its engine (`AsyncEngine`): aborting the requests nobody reads any more."""

    def abort(self, request_ids: str | Sequence[str]) -> None: ...


@dataclass
class RequestSpec:
    """One request to submit: what `LLMEngine.add_request` takes."""

    request_id: str
    prompt: str | Sequence[int] | None
    params: SamplingParams
    prompt_token_ids: Sequence[int] | None = None
    priority: int = 0
    user: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None  # the LoRA adapter the request's `model` names; None: the base model


@dataclass
class EngineCounts:
    """Lifetime request counts kept by the engine thread (for health checks and the soak test)."""

    accepted: int = 0
    rejected: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    step_failures: int = 0

    @property
    def num_finished(self) -> int:
        return sum(self.finished.values())


class RequestStream:
    """The async stream of `RequestOutput`s of one submission (one or more engine requests).

    Iteration ends after every request of the submission delivered its finished output. A request that
    failed without an output (its step raised) raises `RequestFailedError` from the iterator.
    """

    def __init__(self, engine: Aborts, request_ids: Sequence[str], loop: asyncio.AbstractEventLoop,
                 max_backlog: int | None = None) -> None:
        self.request_ids = list(request_ids)
        self.loop = loop
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._unfinished = set(request_ids)
        self._max_backlog = max_backlog
        self._overflowed = False

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Queue an output (on the stream's loop, via call_soon_threadsafe); a reader that fell too far
        behind has its requests aborted instead of having their outputs buffered without bound."""
        if self._overflowed:
            return
        if self._max_backlog is not None and self._queue.qsize() >= self._max_backlog:
            self._overflowed = True
            self._engine.abort([rid for rid in self.request_ids if rid in self._unfinished])
            while not self._queue.empty():
                self._queue.get_nowait()
            item = RequestFailedError(f"the client stopped reading: more than {self._max_backlog} outputs "
                                      "were waiting for it, so its request was aborted")
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def abort(self) -> None:
        """Cancel whatever of this submission is still running (idempotent, returns at once)."""
        if self._unfinished:
            self._engine.abort(list(self._unfinished))
            self._unfinished.clear()



def dispatch(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream._put(item)


def request_finish_reason(output: RequestOutput) -> str:
    reasons = [c.finish_reason for c in output.outputs if c.finish_reason is not None]
    if FinishReason.ERROR in reasons:
        return FinishReason.ERROR
    return reasons[0] if reasons else FinishReason.ABORT


def aborted_output(spec: RequestSpec) -> RequestOutput:
    """The final output of a request the server aborted: no new tokens, finish_reason 'abort'."""
    outputs = [CompletionOutput(index=i, text="", token_ids=[], text_delta="", token_ids_delta=[], logprobs=None,
                                logprobs_delta=None, cumulative_logprob=None, finish_reason=FinishReason.ABORT)
               for i in range(spec.params.n)]
    prompt = spec.prompt if isinstance(spec.prompt, str) else None
    return RequestOutput(spec.request_id, prompt, list(spec.prompt_token_ids or []), None, outputs, finished=True)
