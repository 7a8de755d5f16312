"""The request bodies of routes that read their body themselves, declared in the app's /openapi.json.

The JSON routes take the raw `Request` (the edge guard bounds the body, and it is parsed and validated off
the event loop), so FastAPI cannot see their models; without this the schema says nothing of their bodies,
and neither a client generator nor a schema-driven fuzzer (tests/serving/test_schema_fuzz.py) knows them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def declare_request_bodies(app: FastAPI, bodies: dict[str, tuple[type[BaseModel], ...]]) -> None:
    """Make `app.openapi()` give each POST route in `bodies` a JSON request body: its model, or any of
    them (anyOf)."""
    build: Callable[[], dict[str, Any]] = app.openapi
    declared = False

    def openapi() -> dict[str, Any]:
        nonlocal declared
        schema = build()  # FastAPI's own, cached on the app after the first call
        if not declared:
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, models in bodies.items():
                refs = []
                for model in models:
                    model_schema = model.model_json_schema(ref_template=_REF)
                    components.update(model_schema.pop("$defs", {}))
                    components[model.__name__] = model_schema
                    refs.append({"$ref": _REF.format(model=model.__name__)})
                body = refs[0] if len(refs) == 1 else {"anyOf": refs}
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": body}}}
            declared = True
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
