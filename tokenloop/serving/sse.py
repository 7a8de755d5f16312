"""Server-sent events: a streaming response that notices a client going away, and frame helpers.

Starlette's `StreamingResponse` cancels the body on disconnect but never closes the body iterator, so
the `finally` of the generator (our abort) would wait for garbage collection. `EventStreamResponse`
watches for `http.disconnect` itself, and on any ending (done, disconnect, write error, cancellation)
closes the iterator and calls `on_close`, so the engine stops working for a client that left.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

DONE_FRAME = "data: [DONE]\n\n"


def frame(payload: BaseModel | dict[str, Any], **dump_options: Any) -> str:
    """One SSE frame: `data: <json>` and a blank line."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(**dump_options)
    else:
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {body}\n\n"


class EventStreamResponse(Response):
    """`text/event-stream` over an async iterator of frames, with prompt clean-up on disconnect."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[str], on_close: Callable[[], None] | None = None,
                 status_code: int = 200, headers: dict[str, str] | None = None) -> None:
        self.frames = frames
        self.on_close = on_close
        self.status_code = status_code
        self.background = None
        # No proxy buffering: every token should reach the client as soon as it is sampled.
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    await send({"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})
                    async for chunk in self.frames:
                        await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    group.cancel_scope.cancel()

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(watch_disconnect)
        except OSError:  # the socket broke while writing: same as a disconnect
            logger.debug("client went away during a stream")
        finally:
            # Shielded: the clean-up must run even when this task is being cancelled.
            with anyio.CancelScope(shield=True):
                if self.on_close is not None:
                    self.on_close()
                aclose = getattr(self.frames, "aclose", None)
                if aclose is not None:
                    await aclose()
