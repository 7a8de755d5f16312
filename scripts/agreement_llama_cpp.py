"""How far tokenloop's greedy output agrees with llama.cpp's on the same GGUF (issue 11's report).

Both run the default Q4_1 SmolLM2 file as it is: tokenloop with `--dtype auto` (its packed int4 / Q8_0
kernels), llama.cpp's `llama-server` (built by scripts/baselines/llama_cpp.sh) on 127.0.0.1. Over the 20
fixed prompts of the real-model agreement test, raw text without a chat template, each side decodes
64 greedy tokens (EOS ignored) and the script reports:

- free-running: how many prompts give the same 64 tokens, and the tokens before the first difference;
- teacher-forced top-1 agreement both ways: llama.cpp's argmax at every position of tokenloop's
  continuation (one 1-token completion per position, its prompt cache reused), and tokenloop's argmax
  at every position of llama.cpp's continuation (prompt logprobs of one request per prompt);
- the same two figures for the float32 model of the same file, which neither side is, as the yardstick.

Usage: python scripts/agreement_llama_cpp.py [--port 8091] [--out agreement.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Self

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenloop import LLM, SamplingParams
from tokenloop.bench.datasets import AGREEMENT_PROMPTS

PROMPTS = AGREEMENT_PROMPTS


@dataclass
class Comparison:
    """One pair of greedy decoders over the prompts."""

    pair: str
    identical_prompts: int
    mean_tokens_before_first_difference: float
    teacher_forced_a_on_b: float  # a's argmax at each of b's continuation positions equals b's token
    teacher_forced_b_on_a: float


class LlamaServer:
    """`llama-server` on 127.0.0.1 for the length of a `with` block."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        script = REPO / "scripts" / "baselines" / "llama_cpp.sh"
        env = {**os.environ, "PYTHON": sys.executable}
        # One thread: llama.cpp's two spinning threads crawl (~200 ms a token) when anything else runs on a
        # 2-core machine, and this script times nothing.
        self.process = subprocess.Popen(
            ["bash", str(script), "server", "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", "4096",
             "-t", "1"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self) -> Self:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode} (is it built?)")
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

    def complete(self, tokens: list[int], n_predict: int) -> list[int]:
        """Greedy token ids after `tokens` (no BOS added: the ids are sent as they are)."""
        body = {"prompt": tokens, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": True, "return_tokens": True, "samplers": ["top_k"]}
        request = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.loads(response.read())
        return list(reply["tokens"])


def greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def argmax_on(llm: LLM, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """The engine's argmax at each continuation position, fed the given tokens (prompt logprobs)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([p + c for p, c in zip(prompts, continuations)], params, use_tqdm=False)
    return [[entry.top[0][0] for entry in out.prompt_logprobs[len(p):]] for out, p in zip(outs, prompts)]


def compare(pair: str, a: list[list[int]], b: list[list[int]], a_on_b: list[list[int]],
            b_on_a: list[list[int]]) -> Comparison:
    def first_difference(x: list[int], y: list[int]) -> int:
        return next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))

    def agreement(argmaxes: list[list[int]], reference: list[list[int]]) -> float:
        pairs = [(s, t) for xs, ys in zip(argmaxes, reference) for s, t in zip(xs, ys)]
        return sum(s == t for s, t in pairs) / len(pairs)

    return Comparison(pair, sum(x == y for x, y in zip(a, b)),
                      sum(first_difference(x, y) for x, y in zip(a, b)) / len(a),
                      agreement(a_on_b, b), agreement(b_on_a, a))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    auto = LLM(dtype="auto")
    tokenizer = auto.get_tokenizer()
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    ours = greedy(auto, prompts, args.new_tokens)

    print("tokenloop auto: done; llama.cpp ...", file=sys.stderr, flush=True)
    with LlamaServer(args.port) as server:
        theirs = [server.complete(p, args.new_tokens) for p in prompts]
        theirs_on_ours = [[server.complete(p + c[:i], 1)[0] for i in range(len(c))] for p, c in zip(prompts, ours)]
    ours_on_theirs = argmax_on(auto, prompts, theirs)
    results = [compare("tokenloop auto vs llama.cpp", ours, theirs, ours_on_theirs, theirs_on_ours)]
    del auto

    fp32 = LLM(dtype="float32")
    reference = greedy(fp32, prompts, args.new_tokens)
    fp32_on_ours, fp32_on_theirs = argmax_on(fp32, prompts, ours), argmax_on(fp32, prompts, theirs)
    # The other direction needs each side run on fp32's continuation.
    auto = LLM(dtype="auto")
    ours_on_reference = argmax_on(auto, prompts, reference)
    del auto
    with LlamaServer(args.port) as server:
        theirs_on_reference = [[server.complete(p + c[:i], 1)[0] for i in range(len(c))]
                               for p, c in zip(prompts, reference)]
    results.append(compare("float32 vs tokenloop auto", reference, ours, fp32_on_ours, ours_on_reference))
    results.append(compare("float32 vs llama.cpp", reference, theirs, fp32_on_theirs, theirs_on_reference))

    print(f"{len(prompts)} prompts x {args.new_tokens} greedy tokens, EOS ignored, no chat template")
    print("| pair (a vs b) | identical outputs | mean tokens before the first difference "
          "| teacher-forced: a's top-1 on b's tokens | b's top-1 on a's tokens |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r.pair} | {r.identical_prompts} of {len(prompts)} | {r.mean_tokens_before_first_difference:.1f} "
              f"| {r.teacher_forced_a_on_b:.2%} | {r.teacher_forced_b_on_a:.2%} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"results": [asdict(r) for r in results],
                                        "tokenloop": ours, "llama_cpp": theirs, "float32": reference}))


if __name__ == "__main__":
    main()
