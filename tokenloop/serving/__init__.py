"""Serving: the engine on its own thread (`AsyncEngine`) behind an OpenAI-compatible FastAPI app.

    from tokenloop.serving import create_app, serve_forever
    serve_forever(create_app(engine), "127.0.0.1", 8000)
"""

from tokenloop.serving.api import create_app
from tokenloop.serving.async_engine import AsyncEngine, RequestSpec, RequestStream
from tokenloop.serving.server import ServerThread, serve_forever

__all__ = ["AsyncEngine", "RequestSpec", "RequestStream", "ServerThread", "create_app", "serve_forever"]
