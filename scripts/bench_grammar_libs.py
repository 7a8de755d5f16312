"""xgrammar vs llguidance on this CPU: grammar compile time and per-token mask time on the default model's
vocabulary (49,152 tokens), for the generated test schemas.

    pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi  # xgrammar is only needed for this comparison
    python scripts/bench_grammar_libs.py [--schemas 30] [--steps 40]

Each library walks the same kind of path: at every step a random allowed token (seeded) is accepted, until
the grammar is complete or `--steps` is reached. Reports p50/p99 of compile time and of one mask fill.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.structured.schemas import generate_schemas
from tokenloop.model.loader import load_checkpoint


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1e3


def allowed(mask: torch.Tensor, vocab: int) -> list[int]:
    bits = ((mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


def walk(fill, accept, done, vocab: int, steps: int, rng: random.Random) -> list[float]:
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    times = []
    for _ in range(steps):
        if done():
            break
        begin = time.perf_counter()
        fill(mask)
        times.append(time.perf_counter() - begin)
        ids = allowed(mask[0], vocab)
        if not ids:
            break
        accept(rng.choice(ids))
    return times


def bench_llguidance(backend_json: str, vocab: int, eos: int, schemas, steps: int) -> dict[str, float]:
    import llguidance
    import llguidance.torch

    begin = time.perf_counter()
    tok = llguidance.LLTokenizer(backend_json, n_vocab=vocab, eos_token=eos)
    tokenizer_s = time.perf_counter() - begin
    compiles, masks = [], []
    rng = random.Random(0)
    for schema in schemas:
        begin = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                               defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        compiles.append(time.perf_counter() - begin)
        masks += walk(lambda m, matcher=matcher: llguidance.torch.fill_next_token_bitmask(matcher, m, 0),
                      matcher.consume_token, matcher.is_stopped, vocab, steps, rng)
    return {"tokenizer_s": tokenizer_s, "compile_p50_ms": pct(compiles, 0.5),
            "compile_p99_ms": pct(compiles, 0.99), "mask_p50_ms": pct(masks, 0.5), "mask_p99_ms": pct(masks, 0.99),
            "mask_mean_ms": statistics.mean(masks) * 1e3, "steps": len(masks)}


def bench_xgrammar(backend, vocab: int, eos: int, schemas, steps: int) -> dict[str, float]:
    import transformers
    import xgrammar as xgr

    begin = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    tokenizer_s = time.perf_counter() - begin
    compiles, masks = [], []
    rng = random.Random(0)
    for schema in schemas:
        begin = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        compiles.append(time.perf_counter() - begin)
        matcher = xgr.GrammarMatcher(compiled)
        masks += walk(lambda m, matcher=matcher: matcher.fill_next_token_bitmask(m, 0),
                      matcher.accept_token, matcher.is_terminated,
                      vocab, steps, rng)
    return {"tokenizer_s": tokenizer_s, "compile_p50_ms": pct(compiles, 0.5),
            "compile_p99_ms": pct(compiles, 0.99), "mask_p50_ms": pct(masks, 0.5), "mask_p99_ms": pct(masks, 0.99),
            "mask_mean_ms": statistics.mean(masks) * 1e3, "steps": len(masks)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schemas", type=int, default=30)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = load_checkpoint("smollm2-135m-instruct").tokenizer
    schemas = generate_schemas(args.schemas)
    vocab, eos = tokenizer.vocab_size, tokenizer.eos_token_id
    for name, fn, arg in (("llguidance", bench_llguidance, tokenizer.backend.to_str()),
                          ("xgrammar", bench_xgrammar, tokenizer.backend)):
        result = fn(arg, vocab, eos, schemas, args.steps)
        print(name, json.dumps({k: round(v, 3) for k, v in result.items()}), flush=True)


if __name__ == "__main__":
    main()
