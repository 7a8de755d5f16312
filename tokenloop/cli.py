"""`tokenloop serve | generate`: the command line (room is left for `bench`, `trace`, `simulate`).

    tokenloop serve --model smollm2-135m-instruct --port 8000 --policy fcfs --max-num-seqs 64
    tokenloop generate "The capital of France is" --max-tokens 32 --temperature 0
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from tokenloop.config import SCHEDULING_POLICIES
from tokenloop.errors import TokenloopError
from tokenloop.model.loader import DEFAULT_MODEL

logger = logging.getLogger("tokenloop")

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648, '512MiB', '1.5GB', '1000000' (bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1.5GB, 1000000)")
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return size


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=DEFAULT_MODEL, help="model name, .gguf file or HF checkpoint directory "
                       f"(default: {DEFAULT_MODEL})")
    group.add_argument("--policy", choices=SCHEDULING_POLICIES, default="fcfs", help="scheduling policy")
    group.add_argument("--max-num-seqs", type=_positive_int, help="most requests in one step")
    group.add_argument("--max-num-batched-tokens", type=_positive_int, help="most tokens in one step")
    kv = group.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=_positive_int, help="KV-cache size in blocks")
    kv.add_argument("--kv-cache-memory", type=parse_size, help="KV-cache size in bytes (e.g. 2GiB, 512MiB)")
    group.add_argument("--block-size", type=_positive_int, help="tokens per KV-cache block")
    group.add_argument("--max-model-len", type=_positive_int, help="context length (default: the model's)")
    group.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    group.add_argument("--seed", type=int, help="seed of unseeded sampling")
    group.add_argument("--dtype", choices=["auto", "float32", "bfloat16"],
                       help="activations and KV cache (default auto: float32 activations, and weights in the "
                            "fastest form this CPU runs: a quantized GGUF's packed int4 / Q8_0 blocks, or bf16, "
                            "where it has AVX512-BF16 or AMX; float32 otherwise)")
    group.add_argument("--weight-dtype", choices=["float32", "bfloat16", "quantized"],
                       help="projection weights (default: --dtype, or chosen by auto); bfloat16 halves the bytes "
                            "each step streams; quantized keeps a GGUF's Q4_0/Q4_1/Q8_0 blocks packed for the "
                            "CPU int4 / Q8_0 kernels (bf16 for large batches)")


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"policy": args.policy}
    for name, key in (("max_num_seqs", "max_num_seqs"), ("max_num_batched_tokens", "max_num_batched_tokens"),
                      ("num_kv_blocks", "num_blocks"), ("kv_cache_memory", "kv_cache_memory_bytes"),
                      ("block_size", "block_size"), ("max_model_len", "max_model_len"), ("seed", "seed"),
                      ("dtype", "dtype"), ("weight_dtype", "weight_dtype"),
                      ("max_waiting", "max_waiting")):
        value = getattr(args, name, None)
        if value is not None:
            options[key] = value
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    return options


def _load_engine(args: argparse.Namespace):  # noqa: ANN202 - LLMEngine, imported lazily (torch is slow to import)
    from tokenloop.engine import LLMEngine
    from tokenloop.llm import build_engine_config
    from tokenloop.tracing import Tracer

    config = build_engine_config(args.model, **_engine_options(args))
    begin = time.perf_counter()
    sample_rate = getattr(args, "trace_sample_rate", 0.0)
    # The dashboard and /v1/trace read the tracer; iterations are always recorded, requests sampled.
    tracer = Tracer(sample_rate=sample_rate) if getattr(args, "command", None) == "serve" and not args.no_trace else None
    engine = LLMEngine(config, tracer=tracer)
    logger.info("loaded %s in %.1f s: max_model_len=%d, %d KV blocks of %d tokens, policy=%s; %s", args.model,
                time.perf_counter() - begin, engine.max_model_len, engine.kv_cache.num_blocks,
                config.cache.block_size, config.scheduler.policy, engine.dtype_choice.describe())
    return engine


# ---- serve ----------------------------------------------------------------------------------------

def _start_core_process(args: argparse.Namespace, name: str, limits: Any):  # noqa: ANN202 - AsyncEngine
    """The engine core in its own process; this one keeps only the tokenizer (and the tracer's records)."""
    from tokenloop.llm import build_engine_config
    from tokenloop.metrics import EngineMetrics
    from tokenloop.serving.async_engine import AsyncEngine
    from tokenloop.tracing import Tracer

    config = build_engine_config(args.model, **_engine_options(args))
    tracer = None if args.no_trace else Tracer(sample_rate=args.trace_sample_rate)
    if tracer is not None and not hasattr(tracer, "on_step"):  # records reach only observers of them
        logger.warning("this tracer does not observe StepRecords yet: serving without a trace")
        tracer = None
    begin = time.perf_counter()
    async_engine = AsyncEngine.with_core_process(config, EngineMetrics(name), tracer=tracer,
                                                 max_stream_backlog=limits.max_stream_backlog)
    info = async_engine.client.info
    logger.info("engine core (pid %d) ready in %.1f s: max_model_len=%d, %d KV blocks of %d tokens, "
                "policy=%s; %s",
                info.pid, time.perf_counter() - begin, info.max_model_len, info.num_blocks, info.block_size,
                config.scheduler.policy, info.dtype)
    return async_engine


def _serve(args: argparse.Namespace) -> int:
    from tokenloop.serving.api import create_app
    from tokenloop.serving.server import serve_forever

    from tokenloop.serving.limits import resolve_api_key

    api_key = resolve_api_key(args.api_key, args.api_key_file)
    limits = _server_limits(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        logger.warning("serving on %s without an API key: anyone who can reach it may use it", args.host)
    name = args.served_model_name or args.model
    if args.engine_core == "process":
        engine, async_engine = None, _start_core_process(args, name, limits)
    else:
        engine, async_engine = _load_engine(args), None
    app = create_app(engine, served_model_name=name, api_key=api_key, shutdown_timeout_s=args.shutdown_timeout,
                     limits=limits, async_engine=async_engine)
    logger.info("serving %s on http://%s:%d", args.served_model_name or args.model, args.host, args.port)
    serve_forever(app, args.host, args.port, shutdown_timeout_s=args.shutdown_timeout, log_level=args.log_level)
    logger.info("shut down cleanly")
    return 0


# ---- generate -------------------------------------------------------------------------------------

def _generate(args: argparse.Namespace) -> int:
    from tokenloop.request import SamplingParams

    engine = _load_engine(args)
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


# ---- the parser -----------------------------------------------------------------------------------

_LOG_LEVELS = ["debug", "info", "warning", "error"]

# Server limits: flag -> (ServerLimits field, type, help). Defaults are ServerLimits' own.
_LIMIT_FLAGS = {
    "--max-body-bytes": ("max_body_bytes", parse_size, "largest request body (413 past it)"),
    "--header-read-timeout": ("header_read_timeout_s", float, "seconds a client has to send a request's headers"),
    "--body-read-timeout": ("body_read_timeout_s", float, "seconds a client has to send a request's body (408)"),
    "--max-connections": ("max_concurrent_connections", int, "concurrent connections (503 past it)"),
    "--max-n": ("max_n", int, "largest n (samples per prompt)"),
    "--max-stop-strings": ("max_stop_strings", int, "most stop strings per request"),
    "--max-stop-string-chars": ("max_stop_string_chars", int, "longest stop string"),
    "--max-logit-bias": ("max_logit_bias_entries", int, "most logit_bias entries per request"),
    "--max-stream-backlog": ("max_stream_backlog", int,
                             "outputs a slow reader may fall behind before its request is aborted"),
}


def _add_limit_args(parser: argparse.ArgumentParser) -> None:
    from tokenloop.serving.limits import ServerLimits

    defaults = ServerLimits()
    group = parser.add_argument_group("limits (each bounds what one client may ask)")
    for flag, (field_name, kind, text) in _LIMIT_FLAGS.items():
        group.add_argument(flag, dest=field_name, type=kind, default=getattr(defaults, field_name),
                           help=f"{text} (default {getattr(defaults, field_name)})")


def _server_limits(args: argparse.Namespace):  # noqa: ANN202 - ServerLimits, imported lazily
    from tokenloop.serving.limits import ServerLimits

    return ServerLimits(**{field_name: getattr(args, field_name) for field_name, _, _ in _LIMIT_FLAGS.values()})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenloop", description="A small LLM serving engine.")
    parser.add_argument("--log-level", default="info", choices=_LOG_LEVELS)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="serve an OpenAI-compatible API")
    # Also accepted after the command (`tokenloop serve --log-level warning`), as users type it.
    serve.add_argument("--log-level", default=argparse.SUPPRESS, choices=_LOG_LEVELS)
    _add_engine_args(serve)
    net = serve.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    net.add_argument("--port", type=int, default=8000)
    net.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize "
                                       "(default: $TOKENLOOP_API_KEY; prefer that or --api-key-file: a flag "
                                       "shows in `ps`)")
    net.add_argument("--api-key-file", help="read the API key from this file")
    net.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    net.add_argument("--max-waiting", type=int, help="most queued requests; beyond it: 429 with Retry-After")
    net.add_argument("--shutdown-timeout", type=float, default=5.0,
                     help="seconds in-flight requests get to finish on shutdown before they are aborted")
    net.add_argument("--engine-core", choices=("process", "thread"), default="process",
                     help="run the engine core in its own process (default) or on a thread of the server's")
    _add_limit_args(serve)
    tracing = serve.add_argument_group("tracing")
    tracing.add_argument("--trace-sample-rate", type=float, default=0.1,
                         help="fraction of requests traced in detail for /v1/trace and the dashboard (default 0.1)")
    tracing.add_argument("--no-trace", action="store_true", help="record no trace at all (the dashboard stays empty)")
    serve.set_defaults(func=_serve)

    gen = commands.add_parser("generate", help="generate from one prompt and stream the text to stdout")
    gen.add_argument("--log-level", default=argparse.SUPPRESS, choices=_LOG_LEVELS)
    gen.add_argument("prompt")
    _add_engine_args(gen)
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=_positive_int, default=128)
    sampling.add_argument("--temperature", type=float, default=0.7)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument("--stop", action="append", help="a stop string (repeatable)")
    sampling.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.set_defaults(func=_generate)

    from tokenloop.bench.cli import add_bench_subparser
    from tokenloop.trace_cli import add_trace_subparser

    add_bench_subparser(commands)
    add_trace_subparser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except TokenloopError as exc:  # configuration or model problems: a message, not a traceback
        logger.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
