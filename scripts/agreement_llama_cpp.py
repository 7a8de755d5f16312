"""How far tokenloop's greedy output agrees with llama.cpp's on the same GGUF (issues 11 and 29).

Both run one GGUF file as it is (the default Q4_1 SmolLM2, or `--model FILE`, e.g. the Gemma 3 270M
Q4_K_M): tokenloop with `--dtype auto` (its packed quantized kernels), llama.cpp's `llama-server` (built by
scripts/baselines/llama_cpp.sh) on 127.0.0.1. Over the 20 fixed prompts of the real-model agreement test,
raw text without a chat template (BOS as the file asks), each side decodes 64 greedy tokens (EOS ignored)
and the script reports:

- free-running: how many prompts give the same 64 tokens, and the tokens before the first difference;
- teacher-forced top-1 agreement both ways: llama.cpp's argmax at every position of tokenloop's
  continuation (one 1-token completion per position, its prompt cache reused), and tokenloop's argmax
  at every position of llama.cpp's continuation (prompt logprobs of one request per prompt);
- the same two figures for the float32 model of the same file, which neither side is, as the yardstick;
- per pair, on how many prompts the two continuations share their first 24 characters (issue 29's measure).

Usage: python scripts/agreement_llama_cpp.py [--model NAME_OR_FILE] [--port 8091] [--out agreement.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.llama_server import LlamaServer
from tokenloop import LLM, SamplingParams
from tokenloop.bench.datasets import AGREEMENT_PROMPTS
from tokenloop.model.loader import DEFAULT_MODEL, resolve_model_path

PROMPTS = AGREEMENT_PROMPTS


@dataclass
class Comparison:
    """One pair of greedy decoders over the prompts."""

    pair: str
    identical_prompts: int
    mean_tokens_before_first_difference: float
    teacher_forced_a_on_b: float  # a's argmax at each of b's continuation positions equals b's token
    teacher_forced_b_on_a: float
    same_first_24_chars: int  # prompts whose continuations' texts agree on their first 24 characters


def greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def argmax_on(llm: LLM, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """The engine's argmax at each continuation position, fed the given tokens (prompt logprobs)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([p + c for p, c in zip(prompts, continuations)], params, use_tqdm=False)
    return [[entry.top[0][0] for entry in out.prompt_logprobs[len(p):]] for out, p in zip(outs, prompts)]


def compare(pair: str, a: list[list[int]], b: list[list[int]], a_on_b: list[list[int]],
            b_on_a: list[list[int]], decode: Callable[[list[int]], str]) -> Comparison:
    def first_difference(x: list[int], y: list[int]) -> int:
        return next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))

    def agreement(argmaxes: list[list[int]], reference: list[list[int]]) -> float:
        pairs = [(s, t) for xs, ys in zip(argmaxes, reference) for s, t in zip(xs, ys)]
        return sum(s == t for s, t in pairs) / len(pairs)

    return Comparison(pair, sum(x == y for x, y in zip(a, b)),
                      sum(first_difference(x, y) for x, y in zip(a, b)) / len(a),
                      agreement(a_on_b, b), agreement(b_on_a, a),
                      sum(decode(x)[:24] == decode(y)[:24] for x, y in zip(a, b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a known model name or a GGUF file")
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    path = resolve_model_path(args.model)

    def llama_server() -> LlamaServer:
        return LlamaServer(path, args.port)

    auto = LLM(args.model, dtype="auto")
    tokenizer = auto.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    ours = greedy(auto, prompts, args.new_tokens)

    print("tokenloop auto: done; llama.cpp ...", file=sys.stderr, flush=True)
    with llama_server() as server:
        theirs = [server.complete(p, args.new_tokens) for p in prompts]
        theirs_on_ours = [[server.complete(p + c[:i], 1)[0] for i in range(len(c))] for p, c in zip(prompts, ours)]
    ours_on_theirs = argmax_on(auto, prompts, theirs)
    decode = tokenizer.decode
    results = [compare("tokenloop auto vs llama.cpp", ours, theirs, ours_on_theirs, theirs_on_ours, decode)]
    del auto

    fp32 = LLM(args.model, dtype="float32")
    reference = greedy(fp32, prompts, args.new_tokens)
    fp32_on_ours, fp32_on_theirs = argmax_on(fp32, prompts, ours), argmax_on(fp32, prompts, theirs)
    del fp32
    # The other direction needs each side run on fp32's continuation.
    auto = LLM(args.model, dtype="auto")
    ours_on_reference = argmax_on(auto, prompts, reference)
    del auto
    with llama_server() as server:
        theirs_on_reference = [[server.complete(p + c[:i], 1)[0] for i in range(len(c))]
                               for p, c in zip(prompts, reference)]
    results.append(compare("float32 vs tokenloop auto", reference, ours, fp32_on_ours, ours_on_reference, decode))
    results.append(compare("float32 vs llama.cpp", reference, theirs, fp32_on_theirs, theirs_on_reference, decode))

    print(f"{path.name}: {len(prompts)} prompts x {args.new_tokens} greedy tokens, EOS ignored, no chat template")
    print("| pair (a vs b) | identical outputs | mean tokens before the first difference "
          "| teacher-forced: a's top-1 on b's tokens | b's top-1 on a's tokens | same first 24 characters |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r.pair} | {r.identical_prompts} of {len(prompts)} | {r.mean_tokens_before_first_difference:.1f} "
              f"| {r.teacher_forced_a_on_b:.2%} | {r.teacher_forced_b_on_a:.2%} "
              f"| {r.same_first_24_chars} of {len(prompts)} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"model": str(path), "results": [asdict(r) for r in results],
                                        "tokenloop": ours, "llama_cpp": theirs, "float32": reference}))


if __name__ == "__main__":
    main()
