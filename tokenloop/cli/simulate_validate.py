"""`tokenloop simulate validate`: the same traces replayed for real and simulated, metric by metric.

    tokenloop simulate validate --save-result validation.json --markdown validation.md

1. The profile: `--profile`, or this machine's calibrated profile of `--model` from the cache (calibrated by
   `simulate calibrate`'s sweep now if none exists). It never sees the validation runs.
2. Capacity, per workload: the workload's first requests all arriving at once (a saturating run) on the real
   engine (`--capacity-from real`, the default) or on the simulator (`--capacity-from profile`); capacity
   = completed requests / the run's duration.
3. For each workload (`sharegpt`: ShareGPT-like log-normal lengths, no shared prefixes; `prefix`: most
   prompts start with one of a few shared prefixes) and each load (default 0.5, 0.9, 1.2 x capacity),
   one trace (Poisson arrivals at load x capacity) replayed `--runs` times for real, by `bench policies`'
   in-process replay (fcfs; the real engine over the real model; `--clock real`: the wall clock, as a
   server sees it) and once simulated (deterministic).
4. Per metric (mean and p90 TTFT, mean ITL, output tok/s, preemptions, prefix hit rate): the simulated value,
   the real runs' mean and std, the error, and pass when |simulated - real mean| <= max(10% of the real
   mean, 2 x the real runs' std).

The engine's options (KV blocks, budgets, seed) are the same in every real and simulated run; the default
KV pool is small enough that the overloaded load preempts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

WORKLOADS = ("sharegpt", "prefix")
METRICS = (  # (key, label, unit)
    ("ttft_mean_ms", "mean TTFT", "ms"),
    ("ttft_p90_ms", "p90 TTFT", "ms"),
    ("itl_mean_ms", "mean ITL", "ms"),
    ("output_tok_s", "output tok/s", "tok/s"),
    ("preemptions", "preemptions", ""),
    ("prefix_hit_rate", "prefix hit rate", ""),
)
RELATIVE_TOLERANCE = 0.10
SIGMAS = 2.0


def add_validate_args(parser: argparse.ArgumentParser) -> None:
    """`simulate validate`'s options (the engine group, --model, --dtype, --profile are `simulate`'s)."""
    group = parser.add_argument_group("validate")
    group.add_argument("--runs", type=int, default=3, help="real runs per workload and load (default: %(default)s)")
    group.add_argument("--loads", default="0.5,0.9,1.2",
                       help="arrival rates as fractions of the measured capacity (default: %(default)s)")
    group.add_argument("--workloads", default=",".join(WORKLOADS),
                       help=f"comma-separated, of {', '.join(WORKLOADS)} (default: %(default)s)")
    group.add_argument("--num-requests", type=int, default=60, help="requests per trace (default: %(default)s)")
    group.add_argument("--output-len", default="32:64", metavar="LOW:HIGH",
                       help="output tokens per request, log-normal clipped to [LOW, HIGH] (default: %(default)s)")
    group.add_argument("--prompt-len-median", type=float, default=96.0,
                       help="median prompt tokens (log-normal; default: %(default)s)")
    group.add_argument("--max-prompt-len", type=int, default=384, help="longest prompt (default: %(default)s)")
    group.add_argument("--capacity-from", choices=("real", "profile"), default="real",
                       help="measure capacity by a saturating real run (default) or a simulated one")
    group.add_argument("--capacity-requests", type=int, default=30,
                       help="requests in the saturating capacity run (default: %(default)s)")
    group.add_argument("--clock", choices=("real", "virtual"), default="real",
                       help="the real runs' clock: real (wall clock, default) or virtual (measured step "
                            "durations, idle gaps skipped)")
    group.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")


@dataclasses.dataclass(frozen=True)
class ValidateConfig:
    model: str
    dtype: str
    engine_options: dict[str, Any]
    workloads: tuple[str, ...]
    loads: tuple[float, ...]
    runs: int
    num_requests: int
    output_len: tuple[int, int]
    prompt_len_median: float
    max_prompt_len: int
    capacity_from: str
    capacity_requests: int
    clock: str
    seed: int = 0
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        checks = [
            (not unknown and bool(self.workloads),
             f"unknown workload {unknown[0] if unknown else ''!r} (valid: {', '.join(WORKLOADS)})"),
            (bool(self.loads) and all(load > 0 for load in self.loads), "--loads must be fractions > 0"),
            (self.runs >= 1, "--runs must be >= 1"),
            (self.num_requests >= 2, "--num-requests must be >= 2"),
            (1 <= self.output_len[0] <= self.output_len[1], "--output-len must be LOW:HIGH with 1 <= LOW <= HIGH"),
            (self.capacity_requests >= 2, "--capacity-requests must be >= 2"),
            (self.max_prompt_len >= 4 and self.prompt_len_median >= 1, "prompt lengths must be >= 4"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def _parse_loads(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--loads must be comma-separated numbers, got {text!r}") from None


def _parse_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        return (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise ValueError(f"--output-len must be LOW:HIGH, got {text!r}") from None


# ---- traces ----------------------------------------------------------------------------------------

def workload_trace(workload: str, config: ValidateConfig, vocab_size: int, num_requests: int | None = None,
                   ) -> list[Any]:
    """One workload's requests, arrivals Poisson at 1 req/s (a replay's time_scale sets the load)."""
    from tokenloop.bench.trace import TraceConfig, make_trace

    n = num_requests or config.num_requests
    low, high = config.output_len
    shape: dict[str, dict[str, Any]] = {
        "sharegpt": {"prefix_fraction": 0.0},
        "prefix": {"prefix_fraction": 0.8, "num_prefix_groups": 3, "prefix_len": 64, "hot_prefix_share": 0.5}}
    trace_config = TraceConfig(
        num_requests=n, seed=config.seed + WORKLOADS.index(workload), request_rate=1.0,
        prompt_len_median=config.prompt_len_median, max_prompt_len=config.max_prompt_len,
        output_len_median=math.sqrt(low * high), output_len_sigma=0.4, max_output_len=high,
        priority_classes=((0, 1.0),), num_users=1, token_id_range=(10, max(11, min(vocab_size - 3, 30000))),
        **shape[workload])
    return [dataclasses.replace(r, max_tokens=min(high, max(low, r.max_tokens))) for r in make_trace(trace_config)]


# ---- metrics ---------------------------------------------------------------------------------------

def run_metrics(run: Any) -> dict[str, float | None]:
    """The compared metrics of one replay (a ReplayRun, real or simulated)."""
    from tokenloop.bench.report import summarize_run

    summary = summarize_run(run)
    ttfts = [r.ttft_s for r in run.records if r.success and r.ttft_s is not None]
    return {
        "ttft_mean_ms": summary.overall.latencies["ttft"].mean,
        "ttft_p90_ms": float(np.percentile(ttfts, 90)) * 1e3 if ttfts else None,
        "itl_mean_ms": summary.overall.latencies["itl"].mean,
        "output_tok_s": summary.overall.output_throughput,
        "preemptions": float(run.num_preemptions) if run.num_preemptions is not None else None,
        "prefix_hit_rate": run.prefix_cache_hit_rate,
        "failed": float(summary.overall.failed),
    }


def compare(simulated: float | None, real: Sequence[float | None]) -> dict[str, Any]:
    """One metric: simulated vs the real runs, and pass against max(10%, 2 sigma)."""
    values = [v for v in real if v is not None]
    if simulated is None or not values:
        return {"simulated": simulated, "real_runs": list(real), "real_mean": None, "real_std": None,
                "error": None, "rel_error": None, "tolerance": None, "pass": None}
    mean = float(np.mean(values))
    std = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    error = simulated - mean
    tolerance = max(RELATIVE_TOLERANCE * abs(mean), SIGMAS * std)
    return {"simulated": simulated, "real_runs": values, "real_mean": mean, "real_std": std, "error": error,
            "rel_error": error / abs(mean) if mean else None, "tolerance": tolerance,
            "pass": bool(abs(error) <= tolerance)}


# ---- the runs --------------------------------------------------------------------------------------

def _real_runner(config: ValidateConfig) -> tuple[Callable[[Sequence[Any], float, str], Any], int]:
    """(trace, time_scale, label) -> ReplayRun by `bench policies`' in-process replay (fcfs), and the vocab."""
    from tokenloop.bench.policies import PolicyBenchConfig, run_in_process
    from tokenloop.model.loader import load_checkpoint

    # The engine's own default (quantized weights kept under dtype auto), so the real runs are the engine
    # `simulate calibrate` measured.
    checkpoint = load_checkpoint(config.model, keep_quantized=True)
    warmed: list[bool] = []

    def run(trace: Sequence[Any], time_scale: float, label: str) -> Any:
        # One warm-up engine per process: its one-time costs (allocator, kernel choice) are paid once.
        bench = PolicyBenchConfig(policies=("fcfs",), model=config.model,
                                  engine_options={**config.engine_options, "dtype": config.dtype,
                                                  "kv_cache_dtype": config.kv_cache_dtype},
                                  clock=config.clock, time_scale=time_scale, progress=False, warmup=not warmed)
        warmed.append(True)
        replay = run_in_process(trace, bench, checkpoint)[0]
        replay.label = label
        return replay

    return run, int(checkpoint.config.vocab_size)


def _simulated_run(trace: Sequence[Any], profile: Any, config: ValidateConfig, time_scale: float) -> Any:
    from tokenloop.cli.simulate_runs import simulate_trace

    result, _ = simulate_trace(trace, profile, ["fcfs"], dict(config.engine_options), time_scale=time_scale)
    return result.runs[0]


def _capacity_rps(run: Any) -> float:
    done = [r for r in run.records if r.success]
    if not done or run.duration_s <= 0:
        raise RuntimeError(f"the capacity run completed {len(done)} requests: check the engine options")
    return len(done) / run.duration_s


def validate(config: ValidateConfig, profile: Any, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every (workload, load) cell: real runs, the simulated run, and the comparison; a JSON-able document."""
    from tokenloop.sim.profiles import check_profile_fits

    check_profile_fits(profile, model=config.model, block_size=config.engine_options.get("block_size"))
    began = time.perf_counter()
    real, vocab = _real_runner(config)
    traces = {w: workload_trace(w, config, vocab) for w in config.workloads}
    capacity: dict[str, dict[str, Any]] = {}
    for workload in config.workloads:
        burst = workload_trace(workload, config, vocab, config.capacity_requests)
        scale = 1e-9  # every arrival within a microsecond: the engine is saturated from the start
        run = (real(burst, scale, f"{workload}-capacity") if config.capacity_from == "real"
               else _simulated_run(burst, profile, config, scale))
        capacity[workload] = {"requests_per_s": _capacity_rps(run), "from": config.capacity_from,
                              "requests": len(burst), "duration_s": run.duration_s}
        log(f"capacity of {workload}: {capacity[workload]['requests_per_s']:.3f} req/s "
            f"({config.capacity_from} saturating run of {len(burst)} requests)")

    cells = [(w, load) for w in config.workloads for load in config.loads]
    real_metrics: dict[tuple[str, float], list[dict[str, Any]]] = {cell: [] for cell in cells}
    for index in range(config.runs):  # run by run over all cells, so a drift of the machine spreads evenly
        for workload, load in cells:
            rate = load * capacity[workload]["requests_per_s"]
            run = real(traces[workload], 1.0 / rate, f"{workload}@{load:g}")
            real_metrics[(workload, load)].append(run_metrics(run))
            log(f"real run {index + 1}/{config.runs}: {workload} at {load:g}x ({rate:.3f} req/s): "
                f"{run.duration_s:.1f} s, {run.num_preemptions} preemptions "
                f"[{time.perf_counter() - began:.0f} s elapsed]")
    results = []
    for workload, load in cells:
        rate = load * capacity[workload]["requests_per_s"]
        simulated = run_metrics(_simulated_run(traces[workload], profile, config, 1.0 / rate))
        runs = real_metrics[(workload, load)]
        results.append({
            "workload": workload, "load": load, "arrival_rate": rate,
            "metrics": {key: compare(simulated[key], [m[key] for m in runs]) for key, _, _ in METRICS},
            "failed_requests": {"simulated": simulated["failed"], "real": [m["failed"] for m in runs]},
        })
    verdicts = [m["pass"] for cell in results for m in cell["metrics"].values() if m["pass"] is not None]
    return {
        "goal": f"|simulated - real mean| <= max({RELATIVE_TOLERANCE:.0%} of the real mean, "
                f"{SIGMAS:g} x the real runs' std)",
        "settings": {**dataclasses.asdict(config), "elapsed_s": time.perf_counter() - began},
        "profile": {"name": profile.name, "path": profile.path, "model": profile.model,
                    "hardware": profile.hardware, "source": profile.source, "sources": profile.sources,
                    "calibration": profile.calibration, "coefficients": profile.cost_model.as_dict()},
        "capacity": capacity,
        "cells": results,
        "passed": sum(verdicts), "compared": len(verdicts),
    }


# ---- output ----------------------------------------------------------------------------------------

def _num(value: float | None, key: str) -> str:
    if value is None:
        return "-"
    if key == "prefix_hit_rate":
        return f"{100 * value:.1f}%"
    if key == "preemptions":
        return f"{value:.1f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def table_rows(document: dict[str, Any]) -> list[list[str]]:
    rows = []
    for cell in document["cells"]:
        for key, label, unit in METRICS:
            m = cell["metrics"][key]
            real = ("-" if m["real_mean"] is None else
                    f"{_num(m['real_mean'], key)} ± {_num(m['real_std'], key)} (n={len(m['real_runs'])})")
            error = "-" if m["error"] is None else (
                _num(m["error"], key) + ("" if m["rel_error"] is None else f" ({100 * m['rel_error']:+.0f}%)"))
            verdict = {True: "pass", False: "FAIL", None: "-"}[m["pass"]]
            rows.append([cell["workload"], f"{cell['load']:g}x", f"{label}" + (f" ({unit})" if unit else ""),
                         _num(m["simulated"], key), real, error, _num(m["tolerance"], key), verdict])
    return rows


HEADER = ["workload", "load", "metric", "simulated", "real mean ± std", "error", "tolerance", "verdict"]


def format_text(document: dict[str, Any]) -> str:
    rows = table_rows(document)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    line = "  ".join(f"{h:<{w}}" for h, w in zip(HEADER, widths))
    out = [_headline(document), "", line, "-" * len(line)]
    out += ["  ".join(f"{c:<{w}}" for c, w in zip(row, widths)) for row in rows]
    out += ["", f"{document['passed']} of {document['compared']} comparisons pass; goal: {document['goal']}"]
    out += _warnings(document)
    return "\n".join(out)


def _warnings(document: dict[str, Any]) -> list[str]:
    """Cells where requests failed (refused by the KV pool, errors): their metrics cover the rest only."""
    lines = []
    for cell in document["cells"]:
        failed = cell["failed_requests"]
        if failed["simulated"] or any(failed["real"]):
            lines.append(f"warning: {cell['workload']} at {cell['load']:g}x: failed requests simulated "
                         f"{failed['simulated']:g}, real {[int(f) for f in failed['real']]} (metrics cover the "
                         "completed ones; a larger --num-kv-blocks or shorter prompts avoid refusals)")
    return lines


def format_markdown(document: dict[str, Any]) -> str:
    rows = table_rows(document)
    out = [_headline(document), "", "| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    out += ["", f"{document['passed']} of {document['compared']} comparisons pass; goal: {document['goal']}."]
    out += ["", *_warnings(document)] if _warnings(document) else []
    return "\n".join(out) + "\n"


def _headline(document: dict[str, Any]) -> str:
    s, p = document["settings"], document["profile"]
    capacity = "; ".join(f"{w} {c['requests_per_s']:.3f} req/s" for w, c in document["capacity"].items())
    return (f"Simulated vs real: {s['model']} (dtype {s['dtype']}), {s['runs']} real run(s) per cell on the "
            f"{s['clock']} clock, {s['num_requests']} requests per trace, outputs {s['output_len'][0]}-"
            f"{s['output_len'][1]} tokens, engine {s['engine_options']}\n"
            f"profile {p['name']} ({p['path']}), from: {p['source']}\n"
            f"capacity ({document['capacity'][next(iter(document['capacity']))]['from']} saturating run): "
            f"{capacity}; took {s['elapsed_s']:.0f} s")


# ---- the command -----------------------------------------------------------------------------------

DEFAULT_ENGINE = {"num_blocks": 48, "max_num_seqs": 16, "max_num_batched_tokens": 256}


def run_validate(args: argparse.Namespace) -> int:
    from tokenloop.bench.cli import replay_engine_options
    from tokenloop.cli.simulate_calibrate import resolve_profile, sweep_of
    from tokenloop.model.loader import DEFAULT_MODEL

    model = args.model or DEFAULT_MODEL
    try:
        options = {**DEFAULT_ENGINE, **replay_engine_options(args)}
        config = ValidateConfig(
            model=model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, engine_options=options,
            workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
            loads=_parse_loads(args.loads), runs=args.runs, num_requests=args.num_requests,
            output_len=_parse_range(args.output_len), prompt_len_median=args.prompt_len_median,
            max_prompt_len=args.max_prompt_len, capacity_from=args.capacity_from,
            capacity_requests=args.capacity_requests, clock=args.clock, seed=args.seed)
        sweep = sweep_of(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    profile = resolve_profile(args.profile, model, args.dtype, args.block_size, sweep, args.kv_cache_dtype)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    document = validate(config, profile, log=log)
    print(format_text(document))
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(document, indent=1, default=str), encoding="utf-8")
        print(f"saved the results to {args.save_result}")
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(document), encoding="utf-8")
        print(f"wrote the markdown table to {args.markdown}")
    return 0
