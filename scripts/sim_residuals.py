"""Where a real replay spends the time a step cost model does not charge (issue 13's validation).

    # one real replay of a `simulate validate` cell, every StepRecord and the loop's own timestamps kept
    PYTHONPATH=. python scripts/sim_residuals.py record --workload sharegpt --rate 2.37 --out /tmp/sg09.pkl
    # each step's measured duration against a profile's prediction, by step kind; the wall span's parts
    PYTHONPATH=. python scripts/sim_residuals.py analyze /tmp/sg09.pkl [--profile PATH]

`record` replays the validation trace exactly as `simulate validate` does (fcfs, the engine options of
`DEFAULT_ENGINE`, one warm-up engine first), on the real clock or the virtual one, and pickles the steps,
the instants each `LLMEngine.step()` began and ended, and the requests' records. `resim` simulates a saved
validation's cells again with other profiles, against the same real runs.
`analyze` splits the
run's wall span into step bodies (the `StepRecord`s' [start, end]: what the fit is fitted on), the rest of
`LLMEngine.step()` (output processing, detokenization), the replay loop between steps, and idle time
(nothing unfinished), and prints the residual (measured - predicted) of every step kind.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np


def record(args: argparse.Namespace) -> int:
    from tokenloop.bench.replay import replay_engine, warm_up_engine
    from tokenloop.cli.simulate_validate import (
        DEFAULT_ENGINE,
        ValidateConfig,
        workload_trace,
    )
    from tokenloop.engine import LLMEngine
    from tokenloop.llm import build_engine_config
    from tokenloop.model.loader import DEFAULT_MODEL, load_checkpoint
    from tokenloop.observe.records import EngineObserver, StepRecord

    config = ValidateConfig(model=DEFAULT_MODEL, dtype=args.dtype, engine_options=dict(DEFAULT_ENGINE),
                            workloads=(args.workload,), loads=(1.0,), runs=1, num_requests=args.num_requests,
                            output_len=(32, 64), prompt_len_median=96.0, max_prompt_len=384,
                            capacity_from="real", capacity_requests=30, clock=args.clock)
    checkpoint = load_checkpoint(config.model, keep_quantized=True)
    trace = workload_trace(args.workload, config, int(checkpoint.config.vocab_size))
    engine_config = build_engine_config(config.model, policy="fcfs", **config.engine_options, dtype=args.dtype)
    warm_up_engine(LLMEngine(engine_config, checkpoint=checkpoint), trace)

    steps: list[StepRecord] = []
    calls: list[tuple[int, int]] = []  # LLMEngine.step() begin, end (monotonic ns)

    class Keep(EngineObserver):
        def on_step(self, step: StepRecord) -> None:
            steps.append(step)

    def make_engine(clock: Any) -> LLMEngine:
        engine = LLMEngine(engine_config, checkpoint=checkpoint, clock=clock, observers=[Keep()])
        inner = engine.step

        def timed_step() -> Any:
            began = time.monotonic_ns()
            out = inner()
            calls.append((began, time.monotonic_ns()))
            return out

        engine.step = timed_step  # type: ignore[method-assign]
        return engine

    wall_began = time.monotonic_ns()
    run = replay_engine(trace, make_engine, label=f"{args.workload}@{args.rate:g}", clock_mode=args.clock,
                        time_scale=1.0 / args.rate, progress=False)
    wall_ended = time.monotonic_ns()
    sweep_steps: list[StepRecord] = []
    sweep_periods: list[float] = []
    forms = None
    if args.sweep:  # the calibration sweep right after, in this process: the same machine state to compare
        from tokenloop.cli.simulate_calibrate import Sweep, calibration_records, weight_forms

        sweep = Sweep() if args.sweep == "mixed" else Sweep(mixed_batches=(), mixed_prompts=())
        sweep_steps, sweep_periods, engine = calibration_records(
            config.model, sweep.batches, sweep.contexts, sweep.decode_tokens, dtype=args.dtype,
            mixed_batches=sweep.mixed_batches, mixed_prompts=sweep.mixed_prompts)
        forms = weight_forms(engine.model)
    Path(args.out).write_bytes(pickle.dumps({"sweep_steps": sweep_steps, "sweep_periods": sweep_periods,
                                             "forms": forms,
        "workload": args.workload, "rate": args.rate, "clock": args.clock, "steps": steps, "calls": calls,
        "records": run.records, "wall": (wall_began, wall_ended), "num_preemptions": run.num_preemptions,
        "prefix_hit_rate": run.prefix_cache_hit_rate}))
    itls = [g for r in run.records for g in r.itls_s]
    print(f"{len(steps)} steps, {len(run.records)} requests, duration {run.duration_s:.1f} s, mean ITL "
          f"{1e3 * statistics.fmean(itls):.1f} ms, {run.num_preemptions} preemptions; wrote {args.out}")
    return 0


# ---- analysis --------------------------------------------------------------------------------------

def step_kind(step: Any) -> str:
    decode = sum(1 for c in step.scheduled if c.num_tokens == 1)
    chunks = len(step.scheduled) - decode
    if chunks == 0:
        return f"decode b{decode:02d}"
    if decode == 0:
        return "prefill only"
    return "mixed " + ("b01-04" if decode <= 4 else "b05-08" if decode <= 8 else "b09-16")


def _models(data: dict[str, Any], profiles: list[str] | None) -> dict[str, Any]:
    """The cost models compared: profiles (or the cached calibrated one), and fits of the sweep recorded
    with the run: old terms on the old sweep's steps, and the form terms on the whole sweep's periods."""
    from tokenloop.sim.cost import fit
    from tokenloop.sim.profiles import load_profile

    models = ({Path(p).stem[:18]: load_profile(p).cost_model for p in profiles} if profiles
              else {"cached profile": _cached_model()})
    sweep = data.get("sweep_steps") or []
    if not sweep:
        return models
    old = [r for r in sweep if all(c.request_id.startswith("b") for c in r.scheduled)]
    models["old fit"] = fit(old).model
    if len(old) < len(sweep):
        models["old terms, new sweep"] = fit(sweep).model
    forms = data.get("forms")
    if forms is not None:
        models["forms, old sweep"] = fit(old, forms=forms).model
        periods = data.get("sweep_periods")
        models["forms+period"] = fit(sweep, forms=forms, durations=periods).model
    for name, model in models.items():
        print(f"{name}: {', '.join(f'{k} {v:.3g}' for k, v in model.as_dict().items() if v)}"
              + (f"; forms {model.forms.as_dict()}" if model.forms.as_dict() else ""))
    return models


def analyze(args: argparse.Namespace) -> int:
    from tokenloop.sim.cost import features_of_record

    data = pickle.loads(Path(args.file).read_bytes())
    steps, calls = data["steps"], data["calls"]
    print(f"{data['workload']} at {data['rate']} req/s, {data['clock']} clock: {len(steps)} steps, "
          f"{len(data['records'])} requests")
    models = _models(data, args.profile)

    # Each step's call (the LLMEngine.step() that ran it) and the loop's period from it to the next call.
    call_of = np.searchsorted([b for b, _ in calls], [s.start_ns for s in steps], side="right") - 1
    body = np.array([(s.end_ns - s.start_ns) / 1e9 for s in steps])
    period = body.copy()
    for i, c in enumerate(call_of):
        if c + 1 < len(calls) and calls[c + 1][0] - calls[c][1] < 5_000_000:
            period[i] = (calls[c + 1][0] - calls[c][0]) / 1e9
    rows = np.array([sum(c.samples for c in s.scheduled) for s in steps], dtype=float)
    predicted = {name: np.array([m.step_seconds(features_of_record(s, m.forms)) for s in steps])
                 for name, m in models.items()}
    groups: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(steps):
        groups[step_kind(s)].append(i)
        groups[f"form {s.weight_form}/{'q8' if rows[i] <= 8 else 'fp32'} head"].append(i)
    names = list(models)
    print("\nmeasured: period (call start to next call start); body (StepRecord end - start). "
          "predicted: mean ms and error vs the period")
    print(f"{'kind':22} {'steps':>5} {'period':>7} {'body':>7} " + " ".join(f"{n[:18]:>18}" for n in names)
          + f"  share of '{names[0]}' missing time: all, ITL-weighted")
    missing = float((period - predicted[names[0]]).sum())
    missing_itl = float((rows * (period - predicted[names[0]])).sum())
    for name in sorted(groups) + ["all"]:
        idx = groups[name] if name != "all" else list(range(len(steps)))
        m = period[idx].mean()
        cells = [f"{1e3 * predicted[n][idx].mean():7.1f} {100 * (predicted[n][idx].mean() / m - 1):+6.0f}%"
                 + " " * 3 for n in names]
        gone = period[idx] - predicted[names[0]][idx]
        print(f"{name:22} {len(idx):5d} {1e3 * m:7.1f} {1e3 * body[idx].mean():7.1f} " + " ".join(cells)
              + f"  {100 * gone.sum() / missing:5.0f}% {100 * (rows[idx] * gone).sum() / missing_itl:5.0f}%")
    # What ITL sees: each step weighted by the tokens it samples.
    weighted = float((rows * period).sum() / rows.sum())
    print(f"{'token-weighted step':22} {int(rows.sum()):5d} {1e3 * weighted:7.1f} "
          f"{1e3 * float((rows * body).sum() / rows.sum()):7.1f} " + " ".join(
              f"{1e3 * float((rows * predicted[n]).sum() / rows.sum()):7.1f} "
              f"{100 * (float((rows * predicted[n]).sum() / rows.sum()) / weighted - 1):+6.0f}%   " for n in names))

    # After idle: a step whose call began > 5 ms after the previous call ended (it waited for an arrival:
    # threads parked, caches cold) against the steps run back to back.
    first = next(iter(predicted.values()))
    for label, pick in (("after an idle gap", True), ("back to back", False)):
        idx = [i for i, c in enumerate(call_of) if c > 0 and (calls[c][0] - calls[c - 1][1] > 5_000_000) == pick]
        if idx:
            print(f"{label:22} {len(idx):5d} steps: median body / '{names[0]}' prediction "
                  f"{np.median(body[idx] / first[idx]):.2f}")

    # The wall span: step bodies, the rest of LLMEngine.step(), the loop between calls, idle.
    in_calls = sum(e - b for b, e in calls)
    gaps = [calls[i + 1][0] - calls[i][1] for i in range(len(calls) - 1)]
    busy_gaps = [g for g in gaps if g < 5_000_000]  # longer ones wait for an arrival
    print(f"\nwall span {(calls[-1][1] - calls[0][0]) / 1e9:.2f} s: step bodies {body.sum():.2f} s, rest of "
          f"LLMEngine.step() {(in_calls / 1e9 - body.sum()):.3f} s "
          f"({(in_calls / 1e9 - body.sum()) / len(calls) * 1e3:.2f}"
          f" ms a call), between calls {sum(gaps) / 1e9:.2f} s ({len(busy_gaps)} gaps < 5 ms: mean "
          f"{statistics.fmean(busy_gaps) / 1e6 if busy_gaps else 0:.2f} ms; the rest idle, waiting for arrivals)")
    itls = [g for r in data["records"] for g in r.itls_s]
    print(f"mean ITL {1e3 * statistics.fmean(itls):.2f} ms over {len(itls)} gaps; token-weighted period "
          f"{1e3 * weighted:.2f} ms")
    return 0


def sweep(args: argparse.Namespace) -> int:
    """The mixed calibration sweep alone (the old batch x context part first), pickled for `crossfit`."""
    from tokenloop.cli.simulate_calibrate import Sweep, calibration_records, weight_forms
    from tokenloop.model.loader import DEFAULT_MODEL

    began = time.perf_counter()
    plan = Sweep()
    steps, periods, engine = calibration_records(DEFAULT_MODEL, plan.batches, plan.contexts, plan.decode_tokens,
                                                 dtype=args.dtype, mixed_batches=plan.mixed_batches,
                                                 mixed_prompts=plan.mixed_prompts)
    forms = weight_forms(engine.model)
    Path(args.out).write_bytes(pickle.dumps({"sweep_steps": steps, "sweep_periods": periods, "forms": forms}))
    print(f"{len(steps)} sweep steps in {time.perf_counter() - began:.0f} s, forms {forms}; wrote {args.out}")
    return 0


def crossfit(args: argparse.Namespace) -> int:
    """Fit on the old sweep's steps and predict the mixed sweep's (recorded seconds later in the same
    process, so the machine's load is alike), by step kind; then the same with the form terms."""
    from tokenloop.sim.cost import features_of_record, fit

    data = pickle.loads(Path(args.file).read_bytes())
    steps, periods, forms = data["sweep_steps"], np.array(data["sweep_periods"]), data["forms"]
    old = [i for i, r in enumerate(steps) if r.scheduled and all(c.request_id.startswith("b") for c in r.scheduled)]
    new = [i for i, r in enumerate(steps) if r.scheduled and i not in set(old)]
    body = np.array([(r.end_ns - r.start_ns) / 1e9 for r in steps])
    models = {
        "old terms, old sweep, body": fit([steps[i] for i in old]).model,
        "forms, old sweep, body": fit([steps[i] for i in old], forms=forms).model,
        "old terms, all, period": fit(steps, durations=list(periods)).model,
        "forms, all, period": fit(steps, forms=forms, durations=list(periods)).model,
    }
    for name, model in models.items():
        print(f"{name}: {', '.join(f'{k} {v:.3g}' for k, v in model.as_dict().items() if v)}")
    predicted = {n: np.array([m.step_seconds(features_of_record(r, m.forms)) for r in steps])
                 for n, m in models.items()}
    groups: dict[str, list[int]] = defaultdict(list)
    for i in new:
        groups[step_kind(steps[i])].append(i)
        rows = sum(c.samples for c in steps[i].scheduled)
        groups[f"form {steps[i].weight_form}/{'q8' if rows <= 8 else 'fp32'}"].append(i)
    groups["old sweep (fitted)"] = old
    groups["mixed sweep"] = new
    print("\nthe mixed sweep's steps: measured (body, period) and each fit's prediction (error vs body for "
          "body fits, vs period for period fits)")
    print(f"{'kind':20} {'n':>4} {'body':>7} {'period':>7} " + " ".join(f"{n[:24]:>24}" for n in models))
    for name, idx in groups.items():
        cells = []
        for n in models:
            target = periods[idx].mean() if "period" in n else body[idx].mean()
            mean = predicted[n][idx].mean()
            cells.append(f"{1e3 * mean:14.1f} {100 * (mean / target - 1):+7.0f}% ")
        print(f"{name:20} {len(idx):4d} {1e3 * body[idx].mean():7.1f} {1e3 * periods[idx].mean():7.1f} "
              + " ".join(cells))
    return 0


def resim(args: argparse.Namespace) -> int:
    """A saved `simulate validate` document's cells simulated again with another profile, against the same
    real runs: an old and a new profile side by side on one set of real measurements."""
    import json

    from tokenloop.cli.simulate_validate import (
        METRICS,
        ValidateConfig,
        _simulated_run,
        compare,
        run_metrics,
        workload_trace,
    )
    from tokenloop.sim.profiles import load_profile

    document = json.loads(Path(args.file).read_text())
    settings = {k: v for k, v in document["settings"].items() if k != "elapsed_s"}
    config = ValidateConfig(**{**settings, "workloads": tuple(settings["workloads"]),
                               "loads": tuple(settings["loads"]), "output_len": tuple(settings["output_len"])})
    profiles = {"saved": None, **{Path(p).stem: load_profile(p) for p in args.profile}}
    from tokenloop.model.loader import load_checkpoint

    vocab = int(load_checkpoint(config.model).config.vocab_size)  # the traces' token ids depend on it
    passed = dict.fromkeys(profiles, 0)
    print(f"{'cell':16} {'metric':16} {'real':>16} " + " ".join(f"{n[:22]:>22}" for n in profiles))
    for cell in document["cells"]:
        trace = workload_trace(cell["workload"], config, vocab)
        sims = {"saved": {k: m["simulated"] for k, m in cell["metrics"].items()}}
        for name, profile in profiles.items():
            if profile is not None:
                sims[name] = run_metrics(_simulated_run(trace, profile, config, 1.0 / cell["arrival_rate"]))
        for key, label, _ in METRICS:
            real = cell["metrics"][key]["real_runs"]
            verdicts = {n: compare(sims[n][key], real) for n in profiles}
            for n, v in verdicts.items():
                passed[n] += bool(v["pass"])
            mean = verdicts["saved"]["real_mean"]
            print(f"{cell['workload'] + ' ' + str(cell['load']) + 'x':16} {label:16} {mean:16.4g} " + " ".join(
                f"{v['simulated']:12.4g} {100 * (v['rel_error'] or 0):+5.0f}% {'ok' if v['pass'] else '--'}"
                for v in verdicts.values()))
    print("passed: " + ", ".join(f"{n} {k} of {6 * len(document['cells'])}" for n, k in passed.items()))
    return 0


def _cached_model() -> Any:
    from tokenloop.cli.simulate_calibrate import calibrated_profile

    return calibrated_profile(None).cost_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--workload", default="sharegpt", choices=("sharegpt", "prefix"))
    rec.add_argument("--rate", type=float, required=True, help="arrivals per second")
    rec.add_argument("--num-requests", type=int, default=60)
    rec.add_argument("--clock", default="real", choices=("real", "virtual"))
    rec.add_argument("--dtype", default="auto")
    rec.add_argument("--out", required=True)
    rec.add_argument("--sweep", choices=("old", "mixed"),
                     help="also run a calibration sweep after: the old one (batch x context) or the mixed one")
    rec.set_defaults(func=record)
    ana = sub.add_parser("analyze")
    ana.add_argument("file")
    ana.add_argument("--profile", action="append",
                     help="a profile name or .json, repeatable (default: this machine's calibrated one)")
    ana.set_defaults(func=analyze)
    swp = sub.add_parser("sweep")
    swp.add_argument("--dtype", default="auto")
    swp.add_argument("--out", required=True)
    swp.set_defaults(func=sweep)
    cross = sub.add_parser("crossfit")
    cross.add_argument("file")
    cross.set_defaults(func=crossfit)
    again = sub.add_parser("resim")
    again.add_argument("file", help="a `simulate validate --save-result` document")
    again.add_argument("--profile", action="append", required=True, help="a profile .json to compare, repeatable")
    again.set_defaults(func=resim)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
