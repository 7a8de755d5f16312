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
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenloop.bench.cli import (
    add_replay_engine_args,
    add_result_args,
    replay_engine_options,
    write_result_outputs,
)
from tokenloop.cli.options import positive_int
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


# ---- simulate ------------------------------------------------------------------------------------

def simulate_trace(trace: Sequence[Any], profile: Any, policies: Sequence[str], options: dict[str, Any], *,
                   time_scale: float = 1.0, slos_ms: dict[str, float] | None = None,
                   progress: bool = False) -> tuple[Any, Any]:
    """One simulated replay per policy: (PolicyBenchResult, PolicyBenchConfig), as `bench policies` makes."""
    from tokenloop.bench.policies import PolicyBenchConfig, PolicyBenchResult
    from tokenloop.bench.replay import SIMULATED_CLOCK, replay_engine
    from tokenloop.bench.report import summarize_run
    from tokenloop.llm import build_engine_config
    from tokenloop.sim.energy import StepEnergy, attach_energy, energy_summary
    from tokenloop.sim.engine import SimulatedEngine, cyclic_gc_paused

    options, vocab_size = _profile_options(profile, options, trace)
    config = PolicyBenchConfig(policies=tuple(policies), model=profile.model, engine_options=options,
                               clock=SIMULATED_CLOCK, time_scale=time_scale, slos_ms=slos_ms or {},
                               progress=progress, warmup=False)
    runs = []
    for policy in policies:
        engine_config = build_engine_config(profile.model, policy=policy, **options)
        built: list[SimulatedEngine] = []
        energy = StepEnergy(profile.power_watts) if profile.power_watts is not None else None

        def make_engine(clock: Any, engine_config: Any = engine_config, built: list[SimulatedEngine] = built,
                        energy: StepEnergy | None = energy) -> SimulatedEngine:
            built.append(SimulatedEngine(engine_config, profile.cost_model, clock, vocab_size=vocab_size,
                                         max_model_len=profile.max_model_len,
                                         kv_bytes_per_token=profile.kv_bytes_per_token,
                                         observers=[energy] if energy is not None else ()))
            return built[-1]

        with cyclic_gc_paused():
            run = replay_engine(trace, make_engine, label=policy, clock_mode=SIMULATED_CLOCK,
                                time_scale=time_scale, progress=progress)
        attach_energy(run.records, energy)
        run.settings.update(profile=profile.name, **_run_costs([built[-1].runner], profile,
                                                               sum(r.output_len for r in run.records)))
        if energy is not None:
            run.settings["energy_per_request"] = energy_summary(run.records)
        runs.append(run)
    return PolicyBenchResult(runs, [summarize_run(run, slos_ms or None) for run in runs]), config


def _profile_options(profile: Any, options: dict[str, Any], trace: Sequence[Any]) -> tuple[dict[str, Any], int]:
    """The engine options completed from the profile, and the simulated vocabulary the trace needs."""
    from tokenloop.sim.profiles import check_profile_fits

    # Step costs were measured (or derived) with the profile's blocks; another size is another engine.
    check_profile_fits(profile, block_size=options.get("block_size"))
    options = {"block_size": profile.block_size, **options}
    if "num_blocks" not in options and profile.kv_cache_memory_bytes:
        options["kv_cache_memory_bytes"] = profile.kv_cache_memory_bytes
    # The top two ids are the simulator's filler and EOS tokens: above every prompt id.
    return options, max(max(r.prompt_tokens) for r in trace) + 3


def _run_costs(runners: Sequence[Any], profile: Any, num_output_tokens: int) -> dict[str, Any]:
    """Where a run's modelled time went (which side of the roofline bound its steps) and its energy,
    summed over its engines (one, or a cluster's replicas)."""
    modelled_ns = sum(r.modelled_ns for r in runners)
    costs: dict[str, Any] = {
        "modelled_busy_s": modelled_ns / 1e9,
        "bound_s": {side: sum(r.bound_ns[side] for r in runners) / 1e9 for side in runners[0].bound_ns},
        "bound_steps": {side: sum(r.bound_steps[side] for r in runners) for side in runners[0].bound_steps},
    }
    if profile.power_watts is not None:
        joules = profile.power_watts * modelled_ns / 1e9
        costs["energy_j"] = joules
        costs["energy_j_per_output_token"] = joules / num_output_tokens if num_output_tokens else None
    return costs


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


# ---- calibrate -----------------------------------------------------------------------------------

def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"--{name} must be a comma-separated list of ints >= 1"
                         + (" or none" if name.startswith("mixed") else "") + f", got {text!r}")
    return values


def calibration_records(model: str, batches: Sequence[int], contexts: Sequence[int], decode_tokens: int,
                        seed: int = 0, dtype: str = "auto", block_size: int | None = None,
                        mixed_batches: Sequence[int] = (), mixed_prompts: Sequence[int] = (),
                        kv_cache_dtype: str = "auto") -> tuple[list[Any], list[float], Any]:
    """Run the real engine over the sweep (prefix caching off); every step's record, its period (seconds
    from its start to the next step's, as a serving loop sees it) and the engine.

    First batch x context: `batch` prompts of `context` tokens arrive at once and decode `decode_tokens`
    tokens (pure prefill steps, then pure decode steps). Then, for each of `mixed_batches`, that many
    requests decode while prompts of each of `mixed_prompts` tokens arrive one at a time: the steps
    serving produces, a prompt's chunks next to running decodes, and decode batches of every size around
    the weight forms' switches.
    """
    from tokenloop.engine import LLMEngine
    from tokenloop.llm import build_engine_config
    from tokenloop.observe.records import EngineObserver, StepRecord
    from tokenloop.request import SamplingParams

    records: list[StepRecord] = []

    class Keep(EngineObserver):
        def on_step(self, record: StepRecord) -> None:
            records.append(record)

    longest = max([*contexts, *mixed_prompts])
    config = build_engine_config(model, enable_prefix_caching=False,
                                 max_num_seqs=max([*batches, *(b + 1 for b in mixed_batches)]),
                                 max_num_batched_tokens=max(512, longest), seed=seed, dtype=dtype,
                                 kv_cache_dtype=kv_cache_dtype,
                                 **({"block_size": block_size} if block_size else {}))
    engine = LLMEngine(config, observers=[Keep()])
    rng = random.Random(seed)
    high = min(1000, engine.core.vocab_size)  # ids any vocabulary holds; no special meaning to them
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(10, high) for _ in range(length)]

    direct: list[bool] = []  # whether the record's step was followed at once by the next one

    def run_until(done: Any) -> None:
        while not done():
            before = len(records)
            engine.step()
            if len(records) > before:
                direct[len(direct):] = [True] * (len(records) - len(direct))
        if direct:
            direct[-1] = False  # requests are added next: the gap is the sweep's, not the loop's

    engine.add_request("warmup", None, params, prompt_token_ids=prompt(16))
    run_until(lambda: not engine.has_unfinished_requests())
    records.clear()  # the first steps pay one-time costs
    direct.clear()
    for batch in batches:
        for context in contexts:
            for i in range(batch):
                engine.add_request(f"b{batch}-c{context}-{i}", None, params, prompt_token_ids=prompt(context))
            run_until(lambda: not engine.has_unfinished_requests())
    for batch in mixed_batches:
        # Long enough to outlast every arrival of this batch (each needs its chunks and two decodes).
        # (Some decode already while the others prefill, then two decode steps alone: 64 spare.)
        lasting = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64 + sum(
            3 + -(-p // max(1, config.scheduler.max_num_batched_tokens - batch)) for p in mixed_prompts))
        background = [f"m{batch}-{i}" for i in range(batch)]
        for i, request_id in enumerate(background):
            engine.add_request(request_id, None, lasting, prompt_token_ids=prompt(contexts[i % len(contexts)]))
        run_until(lambda: engine.scheduler.num_waiting == 0 and all(
            r.num_output_tokens > 0 for r in engine.scheduler.running_requests()))
        decoded = len(records)
        run_until(lambda decoded=decoded: len(records) >= decoded + 2)  # two pure decode steps of `batch` rows
        for length in mixed_prompts:
            arrival = f"m{batch}-p{length}"
            engine.add_request(arrival, None, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                               prompt_token_ids=prompt(length))
            run_until(lambda arrival=arrival: arrival not in {
                r.request_id for r in engine.scheduler.running_requests()} and engine.scheduler.num_waiting == 0)
        engine.abort_request(background)
    gaps = [b.start_ns - a.end_ns for a, b, d in zip(records, records[1:], direct) if d]
    gap = float(statistics.median(gaps)) if gaps else 0.0
    periods = [((b.start_ns - a.start_ns) if d else (a.end_ns - a.start_ns + gap)) / 1e9
               for a, b, d in zip(records, [*records[1:], records[-1]], direct)]
    return records, periods, engine


def weight_forms(model: Any, max_rows: int = 4096) -> Any:
    """Where a loaded model switches weight forms by rows (`WeightForms`): the layers by batched tokens
    (`model.weight_form`), the LM head by sampled rows (its `PackedLinear`'s `form_for`)."""
    from tokenloop.sim.cost import WeightForms

    def last_of_first_form(form_for: Any) -> int | None:
        first = form_for(1)
        return next((rows - 1 for rows in range(2, max_rows + 1) if form_for(rows) != first), None)

    head = getattr(model, "lm_head", None)
    head = getattr(head, "weight", head)  # the LMHead wrapper holds the projection
    return WeightForms(last_of_first_form(model.weight_form),
                       last_of_first_form(head.form_for) if hasattr(head, "form_for") else None)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A calibration sweep: every batch size x prompt length, each request generating `decode_tokens`;
    then each of `mixed_batches` decoding while prompts of each of `mixed_prompts` tokens arrive."""

    batches: Sequence[int] = (1, 4, 16)
    contexts: Sequence[int] = (32, 256)
    decode_tokens: int = 12
    seed: int = 0
    mixed_batches: Sequence[int] = (1, 2, 4, 6, 8, 9, 12, 15)
    mixed_prompts: Sequence[int] = (8, 24, 96, 320)
    passes: int = 3  # the sweep run this many times; the profile is the fit of the median-level pass

    def __post_init__(self) -> None:
        if not isinstance(self.passes, int) or self.passes < 1:
            raise ValueError(f"--passes must be an int >= 1, got {self.passes!r}")

    def command(self, model: str, dtype: str, block_size: int, out: str | None = None,
                kv_cache_dtype: str = "auto") -> str:
        kv = [] if kv_cache_dtype == "auto" else ["--kv-cache-dtype", kv_cache_dtype]
        words = ["tokenloop", "simulate", "calibrate", "--model", model, "--dtype", dtype, *kv, "--block-size",
                 str(block_size), "--batches", ",".join(map(str, self.batches)), "--contexts",
                 ",".join(map(str, self.contexts)), "--decode-tokens", str(self.decode_tokens),
                 "--mixed-batches", ",".join(map(str, self.mixed_batches)) or "none",
                 "--mixed-prompts", ",".join(map(str, self.mixed_prompts)) or "none", "--passes", str(self.passes)]
        return " ".join(words + (["--out", out] if out else []))


def median_level_pass(reports: Sequence[Any], steps: Sequence[Any]) -> tuple[int, list[float]]:
    """Which pass's fit to keep, and every fit's level: its predicted seconds for `steps` (all passes'
    steps) over the median fit's. One pass is one sample of the machine's speed: on the shared 2-core VM
    a sweep run just after an idle spell fitted 9% faster than three run back to back a minute later,
    the speed the validation's real runs then saw; the median pass outvotes such a sample."""
    from tokenloop.sim.cost import features_of_record

    totals = [sum(r.model.step_seconds(features_of_record(step, r.model.forms)) for step in steps)
              for r in reports]
    chosen = sorted(range(len(totals)), key=totals.__getitem__)[len(totals) // 2]
    return chosen, [total / totals[chosen] for total in totals]


def calibrate_profile(key: Any, sweep: Sweep, name: str, out: str | None = None) -> dict[str, Any]:
    """Fit this machine's profile for `key` (a CalibrationKey) from a real sweep; the profile document."""
    from tokenloop.sim.cost import fit
    from tokenloop.sim.profiles import fitted_profile

    reports, steps, engine = [], [], None
    for _ in range(sweep.passes):
        engine = None  # one engine's model and pool at a time
        records, periods, engine = calibration_records(key.model, sweep.batches, sweep.contexts,
                                                       sweep.decode_tokens, sweep.seed, key.dtype, key.block_size,
                                                       sweep.mixed_batches, sweep.mixed_prompts,
                                                       key.kv_cache_dtype)
        # Each step's period (start to the next start): what a serving loop's ITL sees, output processing in.
        reports.append(fit(records, forms=weight_forms(engine.model), durations=periods))
        steps.extend(records)
    chosen, levels = median_level_pass(reports, steps)
    report = reports[chosen]
    document = fitted_profile(name, key.model, f"this machine ({key.machine}), {engine.dtype_choice.describe()}",
                              engine.max_model_len, engine.model.kv_bytes_per_block(1), engine.kv_cache.block_size,
                              report, sweep.command(key.model, key.dtype, key.block_size, out, key.kv_cache_dtype),
                              time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    document["fit"] = {"num_steps": report.num_steps, "num_records": report.num_records,
                       "median_abs_rel_error": report.median_abs_rel_error, "mean_step_s": report.mean_step_s,
                       "passes": sweep.passes, "chosen_pass": chosen, "pass_levels": levels}
    return document


def calibrated_profile(model: str | None, dtype: str = "auto", block_size: int | None = None,
                       sweep: Sweep | None = None, *, recalibrate: bool = False, out: str | None = None,
                       kv_cache_dtype: str = "auto") -> Any:
    """This machine's calibrated profile of `model` from the cache; calibrated (and cached) if none exists."""
    from tokenloop.config import CacheConfig
    from tokenloop.sim import profiles

    key = profiles.CalibrationKey.here(model or DEFAULT_MODEL, dtype, block_size or CacheConfig().block_size,
                                       kv_cache_dtype)
    profile = None if recalibrate else profiles.cached_profile(key)
    if profile is not None:
        return profile
    sweep = sweep or Sweep()
    print(f"calibrating {key.model} (dtype {key.dtype}, KV cache {key.kv_cache_dtype}, block size "
          f"{key.block_size}) on {key.machine}: "
          f"{len(sweep.batches) * len(sweep.contexts)} sweep points and {len(sweep.mixed_batches)} mixed "
          f"batches x {len(sweep.mixed_prompts)} arriving prompts, {sweep.passes} pass(es) ...", file=sys.stderr)
    began = time.perf_counter()
    document = calibrate_profile(key, sweep, name=Path(out).stem if out else key.path().stem, out=out)
    path = profiles.write_cached_profile(key, document)
    if out:
        Path(out).write_text(json.dumps({**document, "calibration": key.as_dict()}, indent=1) + "\n",
                             encoding="utf-8")
    fit_report = document["fit"]
    levels = ", ".join(f"{level:.3f}" for level in fit_report["pass_levels"])
    print(f"fitted {fit_report['num_steps']} of {fit_report['num_records']} steps of pass "
          f"{fit_report['chosen_pass'] + 1} of {fit_report['passes']} (the passes' levels: {levels}) in "
          f"{time.perf_counter() - began:.0f} s: median |rel err| {fit_report['median_abs_rel_error']:.3f}; "
          f"cached at {path}" + (f" and wrote {out}" if out else ""), file=sys.stderr)
    return profiles.load_profile(str(path))


def resolve_profile(name: str | None, model: str | None, dtype: str = "auto", block_size: int | None = None,
                    sweep: Sweep | None = None, kv_cache_dtype: str = "auto") -> Any:
    """--profile if given (checked against --model when that is given too), else the calibrated one here."""
    from tokenloop.sim.profiles import check_profile_fits, load_profile

    if name is None:
        return calibrated_profile(model, dtype, block_size, sweep, kv_cache_dtype=kv_cache_dtype)
    profile = load_profile(name)
    check_profile_fits(profile, model=model, block_size=block_size)
    return profile


def sweep_of(args: argparse.Namespace) -> Sweep:
    """The calibration sweep the command line asks for; ValueError naming a bad list."""
    def optional(text: str, name: str) -> list[int]:
        return [] if text.strip().lower() == "none" else _int_list(text, name)

    return Sweep(_int_list(args.batches, "batches"), _int_list(args.contexts, "contexts"), args.decode_tokens,
                 args.seed, optional(args.mixed_batches, "mixed-batches"),
                 optional(args.mixed_prompts, "mixed-prompts"), args.passes)


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
