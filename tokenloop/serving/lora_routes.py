"""Loading and unloading LoRA adapters at run time (vLLM's routes), behind the API key like all of /v1:

    POST /v1/load_lora_adapter    {"lora_name": "a", "lora_path": "/allowed/dir/a"}
    POST /v1/unload_lora_adapter  {"lora_name": "a", "wait_s": 10}

Off unless the server was started with `--lora-dir DIR`; paths must lie under DIR. An unload stops new
requests for the adapter at once (404), waits up to `wait_s` (default 0) for its in-flight requests to finish,
then ends those still running with an error that names the unload.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenloop.errors import AdapterLoadError, ConfigError
from tokenloop.serving.errors import APIError, clipped, invalid

if TYPE_CHECKING:
    from tokenloop.serving.base import ServingBase

MAX_NAME_CHARS = 256
MAX_WAIT_S = 600.0
_POLL_S = 0.05


def make_lora_router(serving: ServingBase, json_body: Callable[[Request], Awaitable[Any]]) -> APIRouter:
    router = APIRouter(prefix="/v1")

    def require_runtime_updates() -> None:
        lora = serving.async_engine.config.lora
        if lora is None or lora.lora_dir is None:
            raise APIError(403, "loading and unloading LoRA adapters at run time is off on this server "
                           "(start it with --lora-dir DIR to allow adapters from DIR)", "permission_error",
                           None, "lora_runtime_updates_disabled")

    def name_of(body: dict[str, Any]) -> str:
        name = body.get("lora_name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise invalid(f"lora_name must be a non-empty string of at most {MAX_NAME_CHARS} characters",
                          "lora_name")
        return name

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(raw: Request) -> JSONResponse:
        require_runtime_updates()
        body = await json_body(raw)
        name, path = name_of(body), body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise invalid("lora_path must be a non-empty string", "lora_path")
        if name in serving.model_aliases or name in serving.lora_adapters:
            raise APIError(409, f"the name {clipped(name)!r} is already served: unload it first",
                           "invalid_request_error", "lora_name", "conflict")
        try:
            loaded = await serving.async_engine.utility("load_lora", name, path)
        except (AdapterLoadError, ConfigError) as exc:
            raise invalid(str(exc), "lora_path") from None
        serving.lora_adapters[name] = path
        return JSONResponse(loaded)

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request) -> JSONResponse:
        require_runtime_updates()
        body = await json_body(raw)
        name = name_of(body)
        wait_s = body.get("wait_s", 0)
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= MAX_WAIT_S:
            raise invalid(f"wait_s must be a number of seconds in [0, {MAX_WAIT_S:g}]", "wait_s")
        serving.check_model(name)  # 404 for a name not served
        if name not in serving.lora_adapters:
            raise invalid(f"{clipped(name)!r} is the base model, not a LoRA adapter", "lora_name")
        path = serving.lora_adapters.pop(name)  # new requests for it get 404 from now on
        engine = serving.async_engine
        try:
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and await engine.utility("lora_in_flight", name):
                await asyncio.sleep(_POLL_S)
            failed = await engine.utility("unload_lora", name)
        except BaseException:
            serving.lora_adapters[name] = path  # still served: the engine did not unload it
            raise
        return JSONResponse({"lora_name": name, "failed_requests": failed})

    return router
