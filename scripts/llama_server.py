"""llama.cpp's `llama-server` on 127.0.0.1 for the length of a `with` block, on any GGUF file.

The binary is the one scripts/baselines/llama_cpp.sh builds (run `llama_cpp.sh build` first). Used by the
scripts that compare with llama.cpp: agreement, tokenization parity, KV memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self


def llama_cpp_bin() -> Path:
    """The directory holding the built llama.cpp binaries."""
    cache = Path(os.environ.get("TOKENLOOP_LLAMA_CPP_DIR") or Path.home() / ".cache" / "tokenloop" / "llama.cpp")
    return cache / "build" / "bin"


class LlamaServer:
    """`llama-server -m MODEL` on 127.0.0.1:`port`; its stderr goes to `log` (or nowhere)."""

    def __init__(self, model: Path, port: int, threads: int = 1, parallel: int = 1, context: int = 4096,
                 extra: Sequence[str] = (), log: Path | None = None) -> None:
        binary = llama_cpp_bin() / "llama-server"
        if not binary.is_file():
            raise RuntimeError(f"{binary} is missing: run scripts/baselines/llama_cpp.sh build")
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        sink = log.open("w") if log is not None else subprocess.DEVNULL
        # One thread by default: llama.cpp's spinning threads crawl when anything else runs on a 2-core
        # machine, and the callers that need speed say how many they want.
        self.process = subprocess.Popen(
            [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel),
             "-c", str(context), "-t", str(threads), *extra],
            stdout=sink, stderr=subprocess.STDOUT)

    def __enter__(self) -> Self:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode} (see {self.log})")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """llama.cpp's token ids of `text`, special-token text parsed as the special token."""
        reply = self.post("/tokenize", {"content": text, "add_special": add_special, "parse_special": True})
        return list(reply["tokens"])

    def complete(self, tokens: list[int], n_predict: int) -> list[int]:
        """Greedy token ids after `tokens` (no BOS added: the ids are sent as they are)."""
        body = {"prompt": tokens, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": True, "return_tokens": True, "samplers": ["top_k"]}
        return list(self.post("/completion", body)["tokens"])
