"""Building a tokenizer from a Hugging Face model directory (`tokenizer.json` and friends)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

from tokenloop.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError

logger = logging.getLogger(__name__)


def pretrained_tokenizer_parts(path: str | Path) -> tuple[RustTokenizer, dict[str, Any]]:
    """The Rust tokenizer of a Hugging Face model directory, and the other `Tokenizer(...)` keywords.

    Reads tokenizer.json, tokenizer_config.json (special tokens, add_bos_token/add_eos_token,
    chat_template), special_tokens_map.json, chat_template.jinja / chat_template.json, and the
    eos ids of generation_config.json and config.json (extra stop tokens).
    """
    root = Path(path)
    if not root.is_dir():
        raise ModelNotFoundError(f"{root}: no such model directory")
    tokenizer_file = root / "tokenizer.json"
    if not tokenizer_file.is_file():
        if (root / "tokenizer.model").is_file():
            raise UnsupportedModelError(f"{root}: has only a SentencePiece tokenizer.model; a tokenizer.json "
                                        "is needed (convert it once with transformers and save it)")
        raise ModelLoadError(f"{root}: no tokenizer.json")
    try:
        backend = RustTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust parser raises a plain Exception
        raise ModelLoadError(f"{tokenizer_file}: cannot parse ({exc})") from exc

    config = _read_json_object(root / "tokenizer_config.json")
    special_map = _read_json_object(root / "special_tokens_map.json")

    def special_id(name: str) -> int | None:
        value = config.get(name, special_map.get(name))
        if isinstance(value, dict):  # AddedToken serialised as {"content": ..., ...}
            value = value.get("content")
        if not isinstance(value, str):
            return None
        found = backend.token_to_id(value)
        if found is None:
            logger.warning("%s: %s %r is not in the vocabulary; ignored", root, name, value)
        return found

    bos_id, eos_id = special_id("bos_token"), special_id("eos_token")
    pad_id, unk_id = special_id("pad_token"), special_id("unk_token")
    extra_eos: list[int] = []
    for name in ("generation_config.json", "config.json"):
        extra_eos.extend(_int_list(_read_json_object(root / name).get("eos_token_id")))
    if eos_id is None and extra_eos:
        eos_id = extra_eos[0]

    template, named = _pretrained_chat_templates(root, config)
    add_bos = config.get("add_bos_token")
    add_eos = config.get("add_eos_token")
    explicit = isinstance(add_bos, bool) or isinstance(add_eos, bool)
    return backend, dict(
        source=str(root),
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        unk_token_id=unk_id,
        extra_eos_token_ids=extra_eos,
        # Like transformers: explicit flags replace the post-processor, otherwise tokenizer.json rules.
        add_bos_token=bool(add_bos) if explicit else None,
        add_eos_token=bool(add_eos) if explicit else None,
        chat_template=template,
        named_chat_templates=named,
    )


def _read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _int_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pretrained_chat_templates(root: Path, config: dict[str, Any]) -> tuple[str | None, dict[str, str]]:
    """The default template and any named ones; a standalone template file wins over the config's."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), {}
    value = _read_json_object(root / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(value, str):
        return value, {}
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {item["name"]: item["template"] for item in value
                 if isinstance(item, dict) and isinstance(item.get("name"), str)
                 and isinstance(item.get("template"), str)}
        default = named.pop("default", None)
        return default, named
    return None, {}
