"""`tokenloop trace`: run one request through an engine with tracing on and write its trace.

    tokenloop trace --prompt "The capital of France is" --format chrome --out trace.json
    tokenloop trace --prompt "Hello" --format mechanism --out request.mechanism.json --concurrent 7 --warm-prefix

`chrome` writes Chrome trace-event JSON (open it at ui.perfetto.dev or chrome://tracing); `mechanism`
writes the request as a scenario in the serving-loop diagram's schema, with measured step durations.
`--concurrent N` runs N more requests alongside (the traced request then shares its steps with them);
`--warm-prefix` runs the prompt once first, so the traced request reuses its cached blocks.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from tokenloop.cli.options import positive_int
from tokenloop.model.loader import DEFAULT_MODEL

logger = logging.getLogger("tokenloop")

TRACED_REQUEST_ID = "trace-0"


def add_trace_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `trace` to a `parser.add_subparsers()` object; the command runs `args.func(args)`."""
    parser = subparsers.add_parser("trace", help="run one request with tracing on and export its trace",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--format", choices=("chrome", "mechanism"), default="chrome",
                        help="chrome: trace-event JSON for Perfetto; mechanism: a serving-loop diagram scenario")
    parser.add_argument("--out", help="file to write (default: stdout)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", default=DEFAULT_MODEL, help=f"model name, .gguf file or HF directory "
                        f"(default: {DEFAULT_MODEL})")
    engine.add_argument("--block-size", type=positive_int, help="tokens per KV-cache block")
    engine.add_argument("--num-kv-blocks", type=positive_int, help="KV-cache size in blocks")
    engine.add_argument("--max-num-seqs", type=positive_int, help="most requests in one step")
    engine.add_argument("--max-num-batched-tokens", type=positive_int, help="most tokens in one step")
    sampling = parser.add_argument_group("sampling and load")
    sampling.add_argument("--max-tokens", type=positive_int, default=16)
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--seed", type=int, help="seed of the traced request's sampling")
    sampling.add_argument("--concurrent", type=int, default=0, help="other requests to run alongside (default 0)")
    sampling.add_argument("--warm-prefix", action="store_true",
                          help="run the prompt once first so the traced request hits the prefix cache")
    parser.set_defaults(func=run_trace)
    return parser


def run_trace(args: argparse.Namespace) -> int:
    """Build a traced engine, run the request (and any companions) to the end, write the export."""
    from tokenloop.engine import LLMEngine
    from tokenloop.llm import build_engine_config
    from tokenloop.observe.tracer import Tracer
    from tokenloop.request import SamplingParams

    options = {key: value for key, value in (
        ("block_size", args.block_size), ("num_blocks", args.num_kv_blocks), ("max_num_seqs", args.max_num_seqs),
        ("max_num_batched_tokens", args.max_num_batched_tokens)) if value is not None}
    tracer = Tracer()
    engine = LLMEngine(build_engine_config(args.model, **options), tracer=tracer)
    tokenizer = engine.tokenizer
    prompt: str = args.prompt
    prompt_ids = None
    if args.chat:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)

    def run_all() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    if args.warm_prefix:
        engine.add_request("warmup", prompt, params, prompt_token_ids=prompt_ids)
        run_all()
    for i in range(max(0, args.concurrent)):
        engine.add_request(f"companion-{i}", prompt, SamplingParams(temperature=0.8, max_tokens=args.max_tokens,
                                                                      seed=i), prompt_token_ids=prompt_ids)
    engine.add_request(TRACED_REQUEST_ID, prompt, params, prompt_token_ids=prompt_ids)
    run_all()

    trace = tracer.get(TRACED_REQUEST_ID)
    assert trace is not None  # sample_rate is 1.0 and the request just finished
    body = tracer.chrome_trace(TRACED_REQUEST_ID) if args.format == "chrome" else tracer.mechanism(TRACED_REQUEST_ID)
    text = json.dumps(body, indent=1 if args.format == "mechanism" else None, ensure_ascii=False)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    else:
        sys.stdout.write(text + "\n")
    e2e = trace.e2e_ns or 0
    output = tokenizer.decode(trace.output_token_ids)
    sys.stderr.write(f"{TRACED_REQUEST_ID}: {trace.num_prompt_tokens} prompt tokens "
                     f"({trace.chunks[0].prefix_hit_tokens if trace.chunks else 0} from the prefix cache), "
                     f"{len(trace.output_token_ids)} output tokens {output!r}, e2e {e2e / 1e6:.1f} ms, "
                     f"finish reason {trace.finish_reason}; wrote {args.format}"
                     f"{' to ' + args.out if args.out else ''}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run `trace` on its own (`python -m tokenloop.cli.trace ...`), logging only warnings."""
    parser = argparse.ArgumentParser(prog="tokenloop")
    add_trace_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
