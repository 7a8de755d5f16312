"""The OpenAI-compatible HTTP app over an `AsyncEngine`: `create_app(engine, ...)` and its routes.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming or not),
POST /tokenize and /detokenize (vLLM's shapes), GET /health, /version, /metrics, and the trace routes.
Every error is an OpenAI error body `{"error": {"message", "type", "param", "code"}}`: 400 for bad
input (including FastAPI's own validation errors), 401 for a missing or wrong API key, 400 for an
unknown model, 429 with Retry-After when the waiting queue is full, 500 when the engine failed the
request, 503 while shutting down.

A client that goes away, streaming or not, has its requests aborted before the engine's next step.
The routes only parse and dispatch: the endpoints' logic is in `completions.py` and `chat.py`, on the
shared `base.ServingBase`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenloop import __version__
from tokenloop.config import ServerLimits
from tokenloop.errors import TokenloopError
from tokenloop.observe.metrics import CONTENT_TYPE, EngineMetrics
from tokenloop.serving.admin_routes import make_admin_router
from tokenloop.serving.async_engine import AsyncEngine
from tokenloop.serving.chat import ChatServing
from tokenloop.serving.completions import CompletionsServing
from tokenloop.serving.errors import APIError, api_error, internal_error, new_incident_id, validation_error
from tokenloop.serving.limits import EdgeGuard
from tokenloop.serving.lora_routes import make_lora_router
from tokenloop.serving.openapi import declare_request_bodies
from tokenloop.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    VersionResponse,
)
from tokenloop.serving.trace_routes import make_trace_router
from tokenloop.serving.validation import parse_json_object, validate_body

if TYPE_CHECKING:  # an app over an engine core in another process never imports the engine (nor torch)
    from tokenloop.engine import LLMEngine

logger = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=BaseModel)
# `json_body(raw, model=None)`: a request's checked JSON body (validated as `model` when given).
BodyReader = Callable[..., Awaitable[Any]]


class OpenAIServing(CompletionsServing, ChatServing):
    """Every endpoint's logic on one shared base: one executor, one token-text cache, one set of checks."""


def _json(model: BaseModel, status: int = 200, exclude_none: bool = False) -> Response:
    return Response(model.model_dump_json(exclude_none=exclude_none), status_code=status,
                    media_type="application/json")


_LIST_CHUNK = 16_384  # list items serialized per call: ~1-2 ms of GIL each


def dump_json_in_pieces(model: BaseModel) -> bytes:
    """`model.model_dump_json()`, with its long lists serialized a slice at a time.

    One serializer call over a million token ids holds the GIL for ~0.1 s (pydantic's and json's encoders
    never release it), which stalls the event loop and the engine thread alike; between slices the
    interpreter may switch threads. The output is the same JSON.
    """
    pieces = []
    for name, value in model:
        if isinstance(value, list) and len(value) > _LIST_CHUNK:
            items = ",".join(json.dumps(value[i:i + _LIST_CHUNK], ensure_ascii=False)[1:-1]
                             for i in range(0, len(value), _LIST_CHUNK))
            pieces.append(f"{json.dumps(name)}:[{items}]")
        else:
            pieces.append(f"{json.dumps(name)}:{json.dumps(value, ensure_ascii=False)}")
    return ("{" + ",".join(pieces) + "}").encode()


def create_app(
    engine: LLMEngine | None,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    shutdown_timeout_s: float = 5.0,
    async_engine: AsyncEngine | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """A FastAPI app serving `engine` (which it runs on its own thread from startup to shutdown), or
    `async_engine` (say, `AsyncEngine.with_core_process`: the core in its own process; `engine` is None).

    `served_model_name` is what clients put in `model` (default: the engine's model name or path).
    With `api_key`, every route that accepts work or reveals request data wants
    `Authorization: Bearer <api_key>` (see `limits.EdgeGuard`). Shutdown lets in-flight requests finish
    for `shutdown_timeout_s`, then aborts the rest.
    """
    limits = limits or ServerLimits()
    if async_engine is None:
        if engine is None:
            raise ValueError("create_app needs an engine or an async_engine")
        model_name = served_model_name or engine.config.model
        async_engine = AsyncEngine(engine, EngineMetrics(model_name),
                                   max_stream_backlog=limits.max_stream_backlog)
    model_name = served_model_name or async_engine.config.model
    metrics = async_engine.metrics
    serving = OpenAIServing(async_engine, model_name, model_aliases=[async_engine.config.model],
                            limits=limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown(shutdown_timeout_s)
            serving.close()

    app = FastAPI(title="tokenloop", version=__version__, lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.limits = limits
    app.add_middleware(EdgeGuard, api_key=api_key, limits=limits)

    _install_error_handlers(app)
    json_body = _body_reader(serving, limits)
    app.include_router(_openai_router(serving, json_body))
    # /v1/trace* and /v1/dashboard/state are behind the key (EdgeGuard); the /dashboard page asks for it.
    app.include_router(make_trace_router(lambda: async_engine.tracer))
    app.include_router(make_admin_router(lambda: async_engine))
    app.include_router(make_lora_router(serving, json_body))  # behind the key: under /v1
    app.include_router(_service_router(serving, async_engine, json_body))
    declare_request_bodies(app, {"/v1/completions": (CompletionRequest,),
                                 "/v1/chat/completions": (ChatCompletionRequest,),
                                 "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),
                                 "/detokenize": (DetokenizeRequest,)})
    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's error body: ours as they are, FastAPI's and Starlette's translated,
    anything unexpected as a 500 with an incident id (the traceback goes to the log, not the client)."""

    @app.exception_handler(APIError)
    async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(TokenloopError)
    async def _on_tokenloop_error(_: Request, exc: TokenloopError) -> JSONResponse:
        error = api_error(exc)
        if error.status >= 500:
            logger.error("%s (%s)", error.message, type(exc).__name__, exc_info=exc)
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), kind, None, None, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _on_unexpected(raw: Request, exc: Exception) -> JSONResponse:
        incident = new_incident_id()
        logger.error("unexpected error while serving %s %s (%s)", raw.method, raw.url.path, incident,
                     exc_info=exc)
        return internal_error(incident).response()


def _body_reader(serving: OpenAIServing, limits: ServerLimits) -> BodyReader:
    """`json_body(raw, model=None)`: the checked body (validated as `model` when given). EdgeGuard has read
    and bounded it already; parsing and validating a body of megabytes is CPU work, so it runs off the
    event loop."""

    async def json_body(raw: Request, model: type[ModelT] | None = None) -> Any:
        body, content_type = await raw.body(), raw.headers.get("content-type")

        def parse() -> Any:
            value = parse_json_object(body, content_type, limits.max_json_depth)
            return value if model is None else validate_body(model, value)

        return await serving.off_loop(parse)

    return json_body


def _openai_router(serving: OpenAIServing, json_body: BodyReader) -> APIRouter:
    """/v1/models, /v1/completions, /v1/chat/completions."""
    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def list_models() -> Response:
        return _json(serving.models(), exclude_none=True)  # the base model's card: OpenAI's four fields

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        adapter = serving.check_model(model_id)
        wanted = adapter or serving.model_name
        return _json(next(card for card in serving.models().data if card.id == wanted), exclude_none=True)

    @v1.post("/completions")
    async def create_completion(raw: Request) -> Response:
        return await serving.completions(await json_body(raw, CompletionRequest), raw)

    @v1.post("/chat/completions")
    async def create_chat_completion(raw: Request) -> Response:
        return await serving.chat(await json_body(raw, ChatCompletionRequest), raw)

    return v1


def _service_router(serving: OpenAIServing, async_engine: AsyncEngine, json_body: BodyReader) -> APIRouter:
    """vLLM's extras beside the OpenAI routes: /tokenize, /detokenize, /health, /version, /metrics."""
    router = APIRouter()
    metrics = async_engine.metrics

    @router.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        body = await json_body(raw)
        result = await serving.off_loop(serving.tokenize, body)
        # A long prompt's ids are a long list: serialized off the loop, in pieces (see dump_json_in_pieces).
        return Response(await serving.off_loop(dump_json_in_pieces, result), media_type="application/json")

    @router.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        req = await json_body(raw, DetokenizeRequest)
        return _json(await serving.off_loop(serving.detokenize, req))

    @router.get("/health")
    async def health() -> Response:
        if not async_engine.is_running or not async_engine.accepting:
            raise APIError(503, "the engine is not running", "server_error", None, "service_unavailable")
        return Response(status_code=200)

    router.add_api_route("/health", health, methods=["HEAD"], operation_id="health_head",
                         include_in_schema=False)  # load balancers probe with HEAD

    @router.get("/version")
    async def version() -> Response:
        return _json(VersionResponse(version=__version__))

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        if metrics is None:
            return Response(b"", media_type=CONTENT_TYPE)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return router
