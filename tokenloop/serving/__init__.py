"""Serving: the engine on its own thread (`AsyncEngine`) behind an OpenAI-compatible FastAPI app.

    from tokenloop.serving import create_app, serve_forever
    serve_forever(create_app(engine), "127.0.0.1", 8000)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenloop.serving.app import create_app
    from tokenloop.serving.async_engine import AsyncEngine, RequestSpec, RequestStream
    from tokenloop.serving.server import ServerThread, serve_forever

# Imported when first named: `tokenloop serve` starts its engine core (tokenloop.serving.core_client)
# before it imports the web framework.
_EXPORTS = {"create_app": "tokenloop.serving.app", "AsyncEngine": "tokenloop.serving.async_engine",
            "RequestSpec": "tokenloop.serving.async_engine", "RequestStream": "tokenloop.serving.async_engine",
            "ServerThread": "tokenloop.serving.server", "serve_forever": "tokenloop.serving.server"}

__all__ = ["AsyncEngine", "RequestSpec", "RequestStream", "ServerThread", "create_app", "serve_forever"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenloop.serving' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
