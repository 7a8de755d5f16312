"""Structured-output cost on the default model: output tok/s at 1, 8 and 32 streams with a JSON schema vs
without (same prompts), grammar compile time (p50, p99) for the 100 test schemas, and the cache hit rate.

    python scripts/bench_structured.py [--max-tokens 64] [--streams 1 8 32]

"Without" runs with ignore_eos, so every request makes exactly max_tokens tokens. "With" runs a schema
that cannot close before max_tokens (a long string field), so both sides do the same work and only the
constraint differs; the 100 test schemas are also run for their mixed, naturally ending outputs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.structured.schemas import generate_schemas
from tokenloop import LLM, SamplingParams
from tokenloop.structured import StructuredOutputsParams
from tokenloop.structured.compiler import GrammarCompiler

LONG = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}}, "required": ["story"]}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, int]:
    begin = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - begin
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--weight-dtype", default="bfloat16", help="projection weights (BENCHMARKS.md option)")
    args = parser.parse_args()
    llm = LLM(max_num_seqs=max(args.streams), max_num_batched_tokens=2048,
              weight_dtype=args.weight_dtype)
    tokenizer = llm.get_tokenizer()
    schemas = generate_schemas(100)

    # Compile time: a cold cache over the 100 schemas, then a skewed trace of 1,000 requests.
    compiler = GrammarCompiler(tokenizer, llm.engine.checkpoint.config.vocab_size, cache_size=64)
    for schema in schemas:
        compiler.compile(StructuredOutputsParams(json=schema))
    cold = list(compiler.stats.compile_s)
    print(f"compile ms over {len(cold)} schemas: p50 {pct(cold, 0.5) * 1e3:.2f}, p99 {pct(cold, 0.99) * 1e3:.2f}, "
          f"max {max(cold) * 1e3:.2f}")
    compiler.stats.hits = compiler.stats.misses = 0
    rng = random.Random(0)
    weights = [1 / (i + 1) for i in range(len(schemas))]  # Zipf-like: a few schemas are most of the traffic
    for schema in rng.choices(schemas, weights, k=1000):
        compiler.compile(StructuredOutputsParams(json=schema))
    print(f"cache (64 entries, 1,000 Zipf requests over 100 schemas): hit rate {compiler.stats.hit_rate:.3f}")

    question = "Tell me a long story about {} as JSON."
    topics = ["the sea", "a cat", "trains", "the moon", "bread", "rain", "chess", "music"]
    llm.generate(["warm up"], SamplingParams(max_tokens=8), use_tqdm=False)
    for streams in args.streams:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": question.format(topics[i % 8])}])
                   for i in range(streams)]
        plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        spec = StructuredOutputsParams(json=LONG)
        constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=spec)
        t0, n0 = run(llm, prompts, [plain] * streams)
        t1, n1 = run(llm, prompts, [constrained] * streams)
        test_specs = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                     structured_outputs=StructuredOutputsParams(json=schemas[i % 100]))
                      for i in range(streams)]
        t2, n2 = run(llm, prompts, test_specs)
        print(json.dumps({"streams": streams, "plain_tok_s": round(n0 / t0, 1), "schema_tok_s": round(n1 / t1, 1),
                          "cost_pct": round(100 * (1 - (n1 / t1) / (n0 / t0)), 1), "tokens": [n0, n1],
                          "test_schemas_tok_s": round(n2 / t2, 1), "test_schemas_tokens": n2}), flush=True)


if __name__ == "__main__":
    main()
