"""`tokenloop simulate`: replay a trace through the real scheduler on a virtual clock priced by a profile.

    tokenloop simulate --trace trace.jsonl --profile h100-llama3-8b --policies fcfs,sjf --report sim.html
    tokenloop simulate --trace trace.jsonl --profile h100-llama3-8b --replicas 8 --router round-robin,cost
    tokenloop simulate --trace trace.jsonl             # this machine's calibrated profile of the default model
    tokenloop simulate profiles
    tokenloop simulate calibrate                       # fit this machine's profile from a real sweep, cache it
    tokenloop simulate validate --save-result v.json   # simulated vs real on the same traces (simulate_validate.py)

Without --profile, `simulate` uses the calibrated profile of --model (default: the default model) on the
machine it runs on, from the cache (~/.cache/tokenloop/profiles/, or $TOKENLOOP_CACHE_DIR/profiles/),
calibrating once and caching it if none exists. The cache is keyed by machine (CPU model and core count),
model, dtype and block size.

The table, the HTML report and the `--save-result` JSON are `bench policies`' own, so a run here and a
simulated run read side by side. Each request produces exactly its `max_tokens` tokens, as in `bench
policies` (ignore_eos, stopped by length); the simulated runner makes the last of them EOS.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

from tokenloop.bench.cli import (
    add_replay_engine_args,
    add_result_args,
    replay_engine_options,
    write_result_outputs,
)
from tokenloop.cli.options import positive_int
from tokenloop.cli.simulate_calibrate import Sweep, calibrated_profile, resolve_profile, sweep_of
from tokenloop.cli.simulate_runs import simulate_trace
from tokenloop.config import KV_CACHE_DTYPES, SCHEDULING_POLICIES
from tokenloop.model.loader import DEFAULT_MODEL

ACTIONS = ("run", "profiles", "calibrate", "validate")


def add_simulate_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `simulate` to a `parser.add_subparsers()` object; the command runs `args.func(args)`."""
    parser = subparsers.add_parser("simulate", help="replay a trace on a simulated engine (a cost profile)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", choices=ACTIONS, default="run",
                        help="run (default): simulate --trace; profiles: list the shipped profiles; "
                             "calibrate: fit a profile of this machine from a real sweep and cache it; "
                             "validate: simulated vs real runs of the same traces")
    parser.add_argument("--trace", help="the JSONL trace to replay")
    parser.add_argument("--profile",
                        help="a shipped profile's name or a profile .json (default: this machine's calibrated "
                             "profile of --model, calibrated and cached if there is none)")
    parser.add_argument("--policies",
                        help=f"comma-separated policies to compare (default: {','.join(SCHEDULING_POLICIES)}; "
                             "fcfs with --replicas)")
    parser.add_argument("--replicas", type=positive_int, default=1,
                        help="simulated engine replicas behind a router (default: %(default)s)")
    parser.add_argument("--router", default="cost",
                        help="with --replicas > 1: comma-separated routers to compare on the same trace, "
                             "of round-robin, least-load, cost (default: %(default)s)")
    parser.add_argument("--max-requests", type=positive_int, help="replay only the first N requests")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply arrival times (< 1 compresses the trace: more load)")
    engine = parser.add_argument_group("engine (fixed across policies)")
    add_replay_engine_args(engine, "KV-cache size in blocks (default: the profile's KV memory)",
                           "default: the profile's")
    add_result_args(parser)
    calibrate = parser.add_argument_group("calibrate (and the default profile)")
    calibrate.add_argument("--model", help=f"the model calibrated (default: {DEFAULT_MODEL}); with --profile, "
                                           "the profile must be for it")
    calibrate.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                           help="the engine dtype calibrated (default: %(default)s)")
    calibrate.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                           help="the KV cache's dtype calibrated (default: %(default)s; a profile of another "
                                "KV dtype is never reused)")
    calibrate.add_argument("--batches", default="1,4,16", help="sweep batch sizes (default: %(default)s)")
    calibrate.add_argument("--contexts", default="32,256", help="sweep prompt lengths (default: %(default)s)")
    calibrate.add_argument("--decode-tokens", type=positive_int, default=12,
                           help="tokens each sweep request generates (default: %(default)s)")
    defaults = Sweep()
    calibrate.add_argument("--mixed-batches", default=",".join(map(str, defaults.mixed_batches)),
                           help="decode batch sizes the mixed sweep runs while prompts arrive, or none "
                                "(default: %(default)s)")
    calibrate.add_argument("--mixed-prompts", default=",".join(map(str, defaults.mixed_prompts)),
                           help="prompt lengths arriving next to each mixed batch, or none (default: %(default)s)")
    calibrate.add_argument("--passes", type=positive_int, default=defaults.passes,
                           help="run the sweep this many times and keep the fit of the pass whose level is "
                                "the median: one pass is one sample of a shared machine's speed "
                                "(default: %(default)s)")
    calibrate.add_argument("--out", help="calibrate: also write the profile to this file (it is always cached)")
    from tokenloop.cli.simulate_validate import add_validate_args

    add_validate_args(parser)
    parser.set_defaults(func=run_simulate)
    return parser


def run_simulate(args: argparse.Namespace) -> int:
    if args.action == "profiles":
        return _list_profiles()
    if args.action == "calibrate":
        return _calibrate(args)
    if args.action == "validate":
        from tokenloop.cli.simulate_validate import run_validate

        return run_validate(args)
    return _simulate(args)


def _list_profiles() -> int:
    from tokenloop.sim.profiles import load_profile, shipped_profiles

    print(f"{'profile':24} {'model':28} {'TP':>2}  hardware")
    for name in shipped_profiles():
        profile = load_profile(name)
        print(f"{name:24} {profile.model:28} {profile.tensor_parallel:>2}  {profile.hardware}")
    return 0


def energy_table(runs: Sequence[Any]) -> str | None:
    """Energy per run and per request (the profile's power x modelled time); None without a power."""
    from tokenloop.bench.report import _fmt, format_rows

    summaries = [run.settings.get("energy_per_request") for run in runs]
    if not any(summaries):
        return None

    def cells(key: str, scale: float = 1.0) -> list[str]:
        return [_fmt(None if s is None or s.get(key) is None else s[key] * scale) for s in summaries]

    rows = [("Energy, all requests (kJ)", cells("total_j", 1e-3)),
            ("Energy per output token (J)", cells("j_per_output_token")),
            ("Energy per request: mean (J)", cells("mean_j")),
            ("Energy per request: p50 / p90 (J)",
             [f"{p50} / {p90}" for p50, p90 in zip(cells("p50_j"), cells("p90_j"))]),
            ("Energy per request: max (J)", cells("max_j"))]
    return format_rows("Energy (busy power x modelled step time; each step shared by its requests' tokens)",
                       [run.label for run in runs], rows)


def _tokenized(trace: list[Any], model: str) -> list[Any]:
    """Text prompts as token ids, by the profile's model's tokenizer (the simulator sees only ids)."""
    if all(r.prompt_tokens is not None for r in trace):
        return trace
    from tokenloop.bench.datasets import load_tokenizer

    tokenizer = load_tokenizer(model)
    return [r if r.prompt_tokens is not None else
            dataclasses.replace(r, prompt=None, prompt_tokens=tuple(tokenizer.encode(r.prompt or "")))
            for r in trace]


def _simulate(args: argparse.Namespace) -> int:
    from tokenloop.bench.metrics import parse_goodput
    from tokenloop.bench.policies import parse_policies
    from tokenloop.bench.report import format_table
    from tokenloop.bench.trace import load_trace

    if not args.trace:
        print("error: simulate needs --trace (or the action `profiles`, `calibrate` or `validate`)", file=sys.stderr)
        return 2
    from tokenloop.cli.simulate_cluster import cluster_table, parse_routers, simulate_cluster

    clustered = args.replicas > 1
    try:
        policies = parse_policies(args.policies or ("fcfs" if clustered else ",".join(SCHEDULING_POLICIES)))
        routers = parse_routers(args.router)
        slos = parse_goodput(args.goodput)
        if args.time_scale <= 0:
            raise ValueError("--time-scale must be > 0")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    trace = load_trace(args.trace)  # TraceFormatError names the file, line and field
    try:
        sweep = sweep_of(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # ProfileError (a TokenloopError): main prints it, exit 2
    profile = resolve_profile(args.profile, args.model, args.dtype, args.block_size, sweep, args.kv_cache_dtype)
    if args.max_requests:
        trace = trace[:args.max_requests]
    trace = _tokenized(trace, profile.model)
    began = time.perf_counter()
    if clustered:
        result, config = simulate_cluster(trace, profile, policies, routers, args.replicas,
                                          replay_engine_options(args), time_scale=args.time_scale, slos_ms=slos)
        print(f"simulated {len(trace)} requests x {len(result.runs)} routers on {args.replicas} replicas of "
              f"profile {profile.name} ({profile.hardware}) in {time.perf_counter() - began:.1f} s")
        print(format_table(result.summaries, bool(slos), title="Router comparison"))
        print(cluster_table(result))
    else:
        result, config = simulate_trace(trace, profile, policies, replay_engine_options(args),
                                        time_scale=args.time_scale, slos_ms=slos, progress=not args.disable_tqdm)
        print(f"simulated {len(trace)} requests x {len(policies)} policies on profile {profile.name} "
              f"({profile.hardware}) in {time.perf_counter() - began:.1f} s")
        print(result.table(with_goodput=bool(slos)))
    energy = energy_table(result.runs)
    if energy:
        print(energy)
    write_result_outputs(result, config, args)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    try:
        sweep = sweep_of(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    profile = calibrated_profile(args.model, args.dtype, args.block_size, sweep, recalibrate=True, out=args.out,
                                 kv_cache_dtype=args.kv_cache_dtype)
    print(f"calibrated {profile.name}: {profile.cost_model.as_dict()}; cached at {profile.path}"
          + (f"; wrote {args.out}" if args.out else ""))
    return 0
