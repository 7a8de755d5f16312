"""Deterministic generated JSON schemas for the structured-output tests and benchmark.

`generate_schemas(100)` gives the same list on every run: nested objects, arrays, string enums,
bounded integers and numbers, required and optional properties, and `$ref` into `$defs`. Strings and
arrays are bounded so that a 135M model can finish most of them within a short `max_tokens`.
"""

from __future__ import annotations

import random
from typing import Any

_WORDS = ["name", "city", "age", "score", "tags", "id", "color", "size", "owner", "items", "price", "level",
          "kind", "title", "count", "active", "rank", "code", "weight", "label"]
_ENUM_WORDS = ["red", "green", "blue", "small", "medium", "large", "yes", "no", "alpha", "beta", "cat", "dog"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "string_pattern"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([5, 8, 12])}
    if kind == "string_pattern":
        return {"type": "string", "pattern": "^[a-z]{1,6}$"}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.choice([5, 100, 1000])}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 100])}
    if kind == "boolean":
        return {"type": "boolean"}
    return {"type": "string", "enum": rng.sample(_ENUM_WORDS, rng.randint(2, 4))}


def _array(rng: random.Random, item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": item, "minItems": rng.choice([0, 1]), "maxItems": rng.choice([2, 3])}


def _object(rng: random.Random, depth: int, defs: dict[str, Any]) -> dict[str, Any]:
    names = rng.sample(_WORDS, rng.randint(1, 3 if depth else 4))
    properties: dict[str, Any] = {}
    for name in names:
        roll = rng.random()
        if depth < 2 and roll < 0.2:
            properties[name] = _object(rng, depth + 1, defs)
        elif roll < 0.35:
            properties[name] = _array(rng, _leaf(rng))
        elif roll < 0.45 and depth < 2:  # a $ref into $defs (never from inside a definition: no cycles)
            ref_name = f"def{len(defs)}"
            defs[ref_name] = _leaf(rng) if rng.random() < 0.6 else _object(rng, 2, defs)
            properties[name] = {"$ref": f"#/$defs/{ref_name}"}
        else:
            properties[name] = _leaf(rng)
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def generate_schemas(count: int = 100, seed: int = 1234) -> list[dict[str, Any]]:
    """`count` distinct JSON schemas (draft 2020-12), the same on every call with the same seed."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for index in range(count):
        defs: dict[str, Any] = {}
        if index % 10 == 9:  # some top-level arrays of objects too
            schema = _array(rng, _object(rng, 1, defs))
        else:
            schema = _object(rng, 0, defs)
        if defs:
            schema["$defs"] = defs
        schema["title"] = f"schema{index}"
        out.append(schema)
    return out
