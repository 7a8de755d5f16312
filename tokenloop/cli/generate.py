"""`tokenloop generate`: one prompt through an engine, its completion streamed to stdout.

    tokenloop generate "The capital of France is" --max-tokens 32 --temperature 0
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from tokenloop.cli.options import LOG_LEVELS, add_engine_args, load_engine, positive_int

logger = logging.getLogger("tokenloop")


def add_generate_subparser(commands: Any) -> argparse.ArgumentParser:
    """Add `generate` to a `parser.add_subparsers()` object; the command runs `args.func(args)`."""
    gen = commands.add_parser("generate", help="generate from one prompt and stream the text to stdout")
    gen.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS)
    gen.add_argument("prompt")
    add_engine_args(gen)
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=positive_int, default=128)
    sampling.add_argument("--temperature", type=float, default=0.7)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument("--stop", action="append", help="a stop string (repeatable)")
    sampling.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.set_defaults(func=_generate)
    return gen


def _generate(args: argparse.Namespace) -> int:
    from tokenloop.request import SamplingParams

    engine = load_engine(args)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or None)
    prompt_ids = None
    prompt: str = args.prompt
    if args.chat:
        tokenizer = engine.tokenizer
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    engine.add_request("generate-0", prompt, params, prompt_token_ids=prompt_ids)
    begin = time.perf_counter()
    num_tokens = 0
    last = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            piece = output.outputs[0]
            num_tokens += len(piece.token_ids_delta)
            sys.stdout.write(piece.text_delta)
            sys.stdout.flush()
            last = output
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - begin
    if last is not None and last.metrics is not None:
        ttft = last.metrics.ttft_s
        logger.info("%d tokens in %.2f s (%.1f tok/s), ttft %.3f s, finish_reason=%s", num_tokens, elapsed,
                    num_tokens / max(elapsed, 1e-9), ttft or 0.0, last.outputs[0].finish_reason)
    return 0
