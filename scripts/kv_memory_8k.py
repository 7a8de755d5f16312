"""KV memory of one 8,192-token request, tokenloop next to llama.cpp, on one GGUF (issue 29's Gemma 3 goal).

tokenloop: the engine (dtype auto, its default 1 GiB KV pool) schedules one request of TOKENS prompt tokens
in one prefill chunk; the blocks the scheduler gives it times the bytes a block takes across the layers is
its KV memory (the forward is not run). Reported beside what full attention on every layer would hold
(every layer keeping every token: what a sliding window's release has to beat) and how many such requests the
default pool fits.

llama.cpp: `llama-server -c TOKENS -np 1` logs the buffers its KV caches take (a sliding-window model gets
a full cache for the global layers and a window-sized one for the others unless --swa-full); the script
prints those lines as they are, with --swa-full and without.

Usage: python scripts/kv_memory_8k.py --model FILE [--tokens 8192] [--port 8095]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.llama_server import LlamaServer
from tokenloop import SamplingParams
from tokenloop.engine import LLMEngine
from tokenloop.llm import build_engine_config

MIB = 1 << 20


def tokenloop_kv(model: str, tokens: int) -> None:
    engine = LLMEngine(build_engine_config(model, dtype="auto", max_model_len=tokens + 8,
                                          max_num_batched_tokens=tokens + 8))
    core = engine.core
    cfg = core.model.config
    block_size = core.config.cache.block_size
    per_block = core.model.kv_bytes_per_block(block_size)
    total_blocks = core.stats().num_free_blocks
    # Token ids spread over the vocabulary: the content does not change how much KV a request holds.
    prompt = [1000 + (i * 7919) % (cfg.vocab_size - 2000) for i in range(tokens - 1)]
    engine.add_request("kv-8k", prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    # One schedule with room for the whole prompt: the blocks the scheduler gives the request for its
    # prefill, without running the forward (minutes for 8k tokens on a loaded 2-core machine).
    core.scheduler.schedule()
    held = total_blocks - core.stats().num_free_blocks
    # A block holds one KV group's layers (config.KVGroup): every layer keeping every token takes a block per
    # group for each block_size tokens.
    per_token_full = per_block / block_size * len(cfg.kv_groups())
    full_bytes = per_token_full * tokens
    held_bytes = held * per_block
    sliding = sum(cfg.is_sliding(i) for i in range(cfg.num_layers))
    print(f"tokenloop: {cfg.num_layers} layers ({sliding} sliding, window {cfg.sliding_window}), "
          f"kv dtype {core.model.kv_dtype}, block {block_size} tokens = {per_block} B over one group's layers")
    print(f"tokenloop: one {tokens}-token request holds {held} blocks = {held_bytes / MIB:.1f} MiB; "
          f"full attention on every layer: {full_bytes / MIB:.1f} MiB; ratio {held_bytes / full_bytes:.3f}")
    print(f"tokenloop: default pool {total_blocks} blocks = {total_blocks * per_block / MIB:.0f} MiB fits "
          f"{total_blocks // max(held, 1)} such requests at once")
    del engine


def llama_cpp_kv(model: Path, tokens: int, port: int) -> None:
    for extra in ((), ("--swa-full",)):
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "llama-server.log"
            # -v: the KV caches' sizes are info lines, which llama-server prints only when verbose.
            with LlamaServer(model, port, context=tokens, extra=("-v", *extra), log=log):
                pass
            # (The server sizes its caches twice, a trial context first: the sizes repeat.)
            lines = dict.fromkeys(re.sub(r"^[\d.]+ \w ", "", line.strip())
                                  for line in log.read_text(errors="replace").splitlines()
                                  if re.search(r"llama_kv_cache: size|creating .*KV cache", line))
        print(f"llama.cpp -c {tokens} -np 1 {' '.join(extra) or '(default)'}:")
        for line in lines:
            print(f"  {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--port", type=int, default=8095)
    parser.add_argument("--skip-llama-cpp", action="store_true")
    args = parser.parse_args()
    tokenloop_kv(args.model, args.tokens)
    if not args.skip_llama_cpp:
        llama_cpp_kv(Path(args.model), args.tokens, args.port)


if __name__ == "__main__":
    main()
