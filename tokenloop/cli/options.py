"""Flags every engine-building command shares (`--model`, `--policy`, KV-cache size...) and the engine they
build; the log-level choices that each command also accepts after its name."""

from __future__ import annotations

import argparse
import logging
import re
import time
from typing import Any

from tokenloop.config import (
    KV_CACHE_DTYPES,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    SpeculativeConfig,
)
from tokenloop.errors import ConfigError
from tokenloop.model.loader import DEFAULT_MODEL

logger = logging.getLogger("tokenloop")

LOG_LEVELS = ["debug", "info", "warning", "error"]

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


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=DEFAULT_MODEL, help="model name, .gguf file or HF checkpoint directory "
                       f"(default: {DEFAULT_MODEL})")
    group.add_argument("--policy", choices=SCHEDULING_POLICIES, default="fcfs", help="scheduling policy")
    group.add_argument("--max-num-seqs", type=positive_int, help="most requests in one step")
    group.add_argument("--max-num-batched-tokens", type=positive_int, help="most tokens in one step")
    group.add_argument("--long-prefill-token-threshold", type=non_negative_int,
                       help="a prompt with more tokens left is a long prefill: it gets this many tokens of a step "
                            "before the others, the rest last (default: half of --max-num-batched-tokens; 0: off)")
    group.add_argument("--max-long-partial-prefills", type=non_negative_int,
                       help="long prefills in progress at once; shorter requests pass the others (default 1; "
                            "0: no limit)")
    kv = group.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=positive_int, help="KV-cache size in blocks")
    kv.add_argument("--kv-cache-memory", type=parse_size, help="KV-cache size in bytes (e.g. 2GiB, 512MiB)")
    group.add_argument("--block-size", type=positive_int, help="tokens per KV-cache block")
    group.add_argument("--max-model-len", type=positive_int, help="context length (default: the model's)")
    group.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    group.add_argument("--seed", type=int, help="seed of unseeded sampling")
    group.add_argument("--device", choices=["cpu", "cuda"], help="where the model runs (default cpu); cuda needs "
                       "a CUDA build of torch and a GPU, and uses the Triton attention kernels when triton is there")
    group.add_argument("--dtype", choices=["auto", "float32", "bfloat16"],
                       help="activations and KV cache (default auto: float32 activations, and weights in the "
                            "fastest form this CPU runs: a quantized GGUF's packed int4 / Q8_0 blocks, or bf16, "
                            "where it has AVX512-BF16 or AMX; float32 otherwise; bfloat16 on cuda)")
    group.add_argument("--weight-dtype", choices=["float32", "bfloat16", "quantized"],
                       help="projection weights (default: --dtype, or chosen by auto); bfloat16 halves the bytes "
                            "each step streams; quantized keeps a GGUF's Q4_0/Q4_1/Q8_0 blocks packed for the "
                            "CPU int4 / Q8_0 kernels (bf16 for large batches)")
    group.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES),
                       help="the KV cache's elements (default auto: bfloat16 under --dtype auto on the CPU, "
                            "halving the bytes decode attention reads; else the activations' dtype); attention "
                            "still sums in float32")
    lora = parser.add_argument_group("LoRA adapters (a request names one in `model`)")
    lora.add_argument("--lora", "--lora-modules", dest="lora", action="append", metavar="NAME=PATH",
                      type=_lora_module, help="serve the adapter at PATH (a PEFT directory or a GGUF "
                                              "LoRA) as model NAME; repeat for more")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora)")
    lora.add_argument("--max-loras", type=positive_int,
                      help="adapters resident at once; a step runs at most this many (least recently used "
                           "swapped out; default 4)")
    lora.add_argument("--max-lora-rank", type=positive_int, help="highest adapter rank served (default 16)")
    lora.add_argument("--lora-dtype", choices=["auto", "int8", "dense"], help="resident adapters: int8 with row "
                      "scales (packed base only), dense (the base's dense dtype), or auto (int8 on a packed base)")
    lora.add_argument("--lora-dir", help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter, for "
                                         "adapters under this directory (default: off)")
    spec = parser.add_argument_group("speculative decoding (n-gram prompt lookup; greedy requests only)")
    spec.add_argument("--speculative-method", choices=list(SPECULATIVE_METHODS),
                      help="turn speculative decoding on: ngram proposes drafts from the request's own tokens")
    spec.add_argument("--num-speculative-tokens", type=positive_int,
                      help=f"draft tokens verified per step (default {SpeculativeConfig.num_speculative_tokens}; "
                           "implies --speculative-method ngram)")
    spec.add_argument("--prompt-lookup-min", type=positive_int,
                      help=f"shortest n-gram matched (default {SpeculativeConfig.prompt_lookup_min})")
    spec.add_argument("--prompt-lookup-max", type=positive_int,
                      help=f"longest n-gram matched (default {SpeculativeConfig.prompt_lookup_max})")
    spec.add_argument("--speculative-disable-by-batch-size", type=positive_int, dest="disable_by_batch_size",
                      help="no drafts in a step while at least this many requests run (default: always draft)")


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"policy": args.policy}
    for name, key in (("max_num_seqs", "max_num_seqs"), ("max_num_batched_tokens", "max_num_batched_tokens"),
                      ("num_kv_blocks", "num_blocks"), ("kv_cache_memory", "kv_cache_memory_bytes"),
                      ("block_size", "block_size"), ("max_model_len", "max_model_len"), ("seed", "seed"),
                      ("device", "device"), ("dtype", "dtype"), ("weight_dtype", "weight_dtype"),
                      ("kv_cache_dtype", "kv_cache_dtype"), ("max_waiting", "max_waiting"),
                      ("long_prefill_token_threshold", "long_prefill_token_threshold"),
                      ("max_long_partial_prefills", "max_long_partial_prefills")):
        value = getattr(args, name, None)
        if value is not None:
            options[key] = value
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    speculative = _speculative_config(args)
    if speculative is not None:
        options["speculative"] = speculative
    flags = (("lora", "lora_modules"), ("max_loras", "max_loras"), ("max_lora_rank", "max_lora_rank"),
             ("lora_dir", "lora_dir"), ("lora_dtype", "lora_dtype"))
    lora = {key: getattr(args, name, None) for name, key in flags}
    lora = {key: value for key, value in lora.items() if value is not None}
    if lora or getattr(args, "enable_lora", False):
        options.update(lora, enable_lora=True)
    return options


def _lora_module(text: str) -> tuple[str, str]:
    """`--lora NAME=PATH` as (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def _speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The speculative flags as a config; None when none is given; ConfigError for a bad combination."""
    method = getattr(args, "speculative_method", None)
    num = getattr(args, "num_speculative_tokens", None)
    lookup = {key: getattr(args, key, None)
              for key in ("prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size")}
    lookup = {key: value for key, value in lookup.items() if value is not None}
    if method is None and num is None:
        if lookup:
            raise ConfigError("--prompt-lookup-min/--prompt-lookup-max/--speculative-disable-by-batch-size need "
                              "speculative decoding on "
                              "(--speculative-method ngram or --num-speculative-tokens K)")
        return None
    options: dict[str, Any] = {"method": method or "ngram", **lookup}
    if num is not None:
        options["num_speculative_tokens"] = num
    return SpeculativeConfig(**options)


def load_engine(args: argparse.Namespace):  # LLMEngine, imported lazily (torch is slow to import)
    from tokenloop.engine import LLMEngine
    from tokenloop.llm import build_engine_config
    from tokenloop.observe.tracer import Tracer

    config = build_engine_config(args.model, **_engine_options(args))
    begin = time.perf_counter()
    sample_rate = getattr(args, "trace_sample_rate", 0.0)
    # The dashboard and /v1/trace read the tracer; iterations are always recorded, requests sampled.
    serving = getattr(args, "command", None) == "serve"
    tracer = Tracer(sample_rate=sample_rate) if serving and not args.no_trace else None
    engine = LLMEngine(config, tracer=tracer)
    logger.info("loaded %s in %.1f s: max_model_len=%d, %d KV blocks of %d tokens, policy=%s; %s", args.model,
                time.perf_counter() - begin, engine.max_model_len, engine.kv_cache.num_blocks,
                config.cache.block_size, config.scheduler.policy, engine.dtype_choice.describe())
    return engine
