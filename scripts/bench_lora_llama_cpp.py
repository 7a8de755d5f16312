"""One stream with a LoRA adapter: tokenloop's server beside llama.cpp's `llama-server --lora`, the same file.

    PYTHONPATH=. python scripts/bench_lora_llama_cpp.py [--rounds 2] [--requests 4] [--tokens 64]

A random rank-16 adapter on all seven projections of every layer of the default model (SmolLM2-135M), written
as PEFT writes it (scripts/bench_lora.py) and converted to a GGUF LoRA in llama.cpp's layout with the `gguf`
package (`general.type` = adapter, `adapter.lora.alpha`, tensors `blk.N.attn_q.weight.lora_a` ..., F16 as
llama.cpp's convert_lora_to_gguf.py writes by default, B's Q/K rows interleaved as its converter does).
Both servers load that one file (`tokenloop serve --lora ad=FILE`, `llama-server --lora FILE`), on 127.0.0.1,
one after the other: first the same greedy completion from each with and without the adapter (llama.cpp's
per-request `lora` scale 0 for the base, no prompt cache), then `--rounds` rounds alternating the two servers,
each round `--requests` greedy completions of `--tokens` tokens one after another from the same `openai` client.
Output tok/s counts the prefill's time too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import numpy as np
import openai
from bench_lora import write_adapter
from llama_server import LlamaServer

from tokenloop.config import DEFAULT_MODEL
from tokenloop.model.loader import load_checkpoint, resolve_model_path
from tokenloop.model.lora import _MODULE_PREFIX

PROMPT = "The capital of France is Paris. The capital of Germany is"
# PEFT module -> llama.cpp's tensor name of its base projection.
_GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def interleave_rope_rows(b: np.ndarray, heads: int) -> np.ndarray:
    """B's rows of Q or K in llama.cpp's order: its converter interleaves each head's two rotary halves."""
    rows = b.shape[0]
    return b.reshape(heads, 2, rows // heads // 2, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape)


def write_gguf_lora(peft_dir: Path, out: Path, alpha: float, num_heads: int, num_kv_heads: int) -> Path:
    """A GGUF LoRA from a PEFT directory, laid out as llama.cpp's convert_lora_to_gguf.py lays it out."""
    import gguf
    from safetensors.numpy import load_file

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    heads = {"q_proj": num_heads, "k_proj": num_kv_heads}
    for key, array in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        parts = key.split(".")  # base_model.model.model.layers.N.<self_attn|mlp>.<module>.lora_<A|B>.weight
        layer, module, half = int(parts[4]), parts[6], parts[7][-1].lower()
        if half == "b" and module in heads:
            array = interleave_rope_rows(array, heads[module])
        writer.add_tensor(f"blk.{layer}.{_GGUF_NAMES[module]}.weight.lora_{half}", array.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@contextmanager
def tokenloop_server(port: int, adapter: Path, log: Path, hang_timeout_s: float = 5.0) -> Iterator[str]:
    """`tokenloop serve --lora ad=ADAPTER` on 127.0.0.1 for the length of the block."""
    command = [sys.executable, "-m", "tokenloop", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "auto", "--lora", f"ad={adapter}", "--max-lora-rank", "16", "--no-trace",
               "--log-level", "warning", "--hang-timeout", str(hang_timeout_s)]
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"tokenloop serve exited with {process.returncode} (see {log})")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("tokenloop serve did not become healthy in 300 s") from None
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextmanager
def llama_cpp_server(model: Path, port: int, threads: int, adapter: Path, log: Path) -> Iterator[str]:
    """`llama-server -m MODEL --lora ADAPTER` on 127.0.0.1 for the length of the block."""
    with LlamaServer(model, port, threads=threads, extra=["--lora", str(adapter)], log=log) as server:
        yield server.url


def complete(url: str, model: str, tokens: int, **extra: object) -> tuple[str, int, float]:
    """(text, completion tokens, seconds) of one greedy completion of PROMPT."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    begin = time.perf_counter()
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                      extra_body={"ignore_eos": True, **extra})
    seconds = time.perf_counter() - begin
    assert reply.usage is not None
    return reply.choices[0].text, reply.usage.completion_tokens, seconds


def first_token_top(url: str, model: str, count: int = 5, **extra: object) -> dict[str, float]:
    """The `count` likeliest first tokens after PROMPT and their logprobs (llama.cpp answers in the chat
    completions' `content` form, tokenloop in the completions' `top_logprobs` form)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=count,
                                      extra_body=extra)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None
    content = getattr(logprobs, "content", None)
    if content:
        return {t["token"]: t["logprob"] for t in content[0]["top_logprobs"]}
    assert logprobs.top_logprobs is not None
    return dict(logprobs.top_logprobs[0])


def one_stream(url: str, model: str, requests: int, tokens: int) -> float:
    """Output tok/s of `requests` greedy completions one after another (prefill included)."""
    complete(url, model, 4)  # warm
    results = [complete(url, model, tokens) for _ in range(requests)]
    return sum(n for _, n, _ in results) / sum(s for _, _, s in results)


def common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--scale", type=float, default=0.05, help="std of the random A and B entries")
    parser.add_argument("--check-tokens", type=int, default=16)
    parser.add_argument("--port", type=int, default=18931)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's -t")
    parser.add_argument("--hang-timeout", type=float, default=5.0,
                        help="tokenloop serve's --hang-timeout (0: off; a loaded machine can stretch one step)")
    args = parser.parse_args()
    model_file = Path(resolve_model_path(DEFAULT_MODEL))
    config = load_checkpoint(DEFAULT_MODEL).config
    assert set(_MODULE_PREFIX) == set(_GGUF_NAMES)
    with tempfile.TemporaryDirectory() as tmp:
        peft_dir = write_adapter(Path(tmp) / "peft", config, args.rank, seed=0, scale=args.scale)
        adapter = write_gguf_lora(peft_dir, Path(tmp) / "adapter.gguf", 2 * args.rank, config.num_heads,
                                  config.num_kv_heads)
        print(f"adapter: rank {args.rank}, alpha {2 * args.rank}, entries ~N(0, {args.scale}^2), "
              f"{adapter.stat().st_size / 1e6:.1f} MB GGUF (F16); llama.cpp -t {args.threads}")

        def serve(target: str) -> AbstractContextManager[str]:
            if target == "tokenloop":
                return tokenloop_server(args.port, adapter, Path(tmp) / "tokenloop.log", args.hang_timeout)
            return llama_cpp_server(model_file, args.port, args.threads, adapter, Path(tmp) / "llama.log")

        texts: dict[tuple[str, str], str] = {}
        tops: dict[tuple[str, str], dict[str, float]] = {}
        for target in ("tokenloop", "llama.cpp"):
            with serve(target) as url:
                # llama.cpp: the adapter's scale named in each request, and no prompt cache (its cached prompt
                # KV is reused across requests of different adapter scales).
                lora_on, lora_off = ({}, {}) if target == "tokenloop" else (
                    {"lora": [{"id": 0, "scale": scale}], "cache_prompt": False} for scale in (1.0, 0.0))
                base_model = DEFAULT_MODEL if target == "tokenloop" else "ad"
                texts[target, "adapter"] = complete(url, "ad", args.check_tokens, **lora_on)[0]
                texts[target, "base"] = complete(url, base_model, args.check_tokens, **lora_off)[0]
                tops[target, "adapter"] = first_token_top(url, "ad", **lora_on)
                tops[target, "base"] = first_token_top(url, base_model, **lora_off)
        for kind in ("base", "adapter"):
            ours, theirs = texts["tokenloop", kind], texts["llama.cpp", kind]
            print(f"{kind:7s} greedy {args.check_tokens} tokens: tokenloop {ours!r}\n"
                  f"{'':22s} llama.cpp {theirs!r}\n{'':22s} same for the first {common_prefix(ours, theirs)} "
                  f"of {len(ours)} characters")
            ours_top, theirs_top = tops["tokenloop", kind], tops["llama.cpp", kind]
            shared = sorted(set(ours_top) & set(theirs_top), key=lambda t: -theirs_top[t])
            print(f"{'':8s}first token, top 5 logprobs (tokenloop / llama.cpp): " + ", ".join(
                f"{t!r} {ours_top[t]:.2f} / {theirs_top[t]:.2f}" for t in shared) +
                f"; {len(shared)} of 5 in both")
        print(f"the adapter changed the text: tokenloop {texts['tokenloop', 'base'] != texts['tokenloop', 'adapter']}"
              f", llama.cpp {texts['llama.cpp', 'base'] != texts['llama.cpp', 'adapter']}")

        speeds: dict[str, list[float]] = {"tokenloop": [], "llama.cpp": []}
        for round_index in range(args.rounds):
            for target in speeds:
                with serve(target) as url:
                    speeds[target].append(one_stream(url, "ad", args.requests, args.tokens))
                print(f"round {round_index + 1} {target}: {speeds[target][-1]:.1f} tok/s "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
        ours, theirs = statistics.median(speeds["tokenloop"]), statistics.median(speeds["llama.cpp"])
        print(f"one stream with the adapter, median: tokenloop {ours:.1f} tok/s, llama.cpp {theirs:.1f} tok/s "
              f"({ours / theirs:.2f}x)")


if __name__ == "__main__":
    main()
