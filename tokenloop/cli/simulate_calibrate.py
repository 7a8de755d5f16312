"""Calibration: run the real engine over a sweep, fit a step-cost profile of this machine, cache it; and
resolve a --profile name (or the calibrated profile) for `tokenloop simulate` and its validate command."""

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

from tokenloop.model.loader import DEFAULT_MODEL


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

    sweep = _Sweep(seed, decode_tokens)

    class Keep(EngineObserver):
        def on_step(self, record: StepRecord) -> None:
            sweep.records.append(record)

    longest = max([*contexts, *mixed_prompts])
    config = build_engine_config(model, enable_prefix_caching=False,
                                 max_num_seqs=max([*batches, *(b + 1 for b in mixed_batches)]),
                                 max_num_batched_tokens=max(512, longest), seed=seed, dtype=dtype,
                                 kv_cache_dtype=kv_cache_dtype,
                                 **({"block_size": block_size} if block_size else {}))
    engine = LLMEngine(config, observers=[Keep()])
    sweep.engine = engine
    sweep.warm_up()
    for batch in batches:
        for context in contexts:
            for i in range(batch):
                engine.add_request(f"b{batch}-c{context}-{i}", None, sweep.params,
                                   prompt_token_ids=sweep.prompt(context))
            sweep.run_until(lambda: not engine.has_unfinished_requests())
    for batch in mixed_batches:
        sweep.mixed(batch, contexts, mixed_prompts, config.scheduler.max_num_batched_tokens)
    return sweep.records, sweep.periods(), engine


class _Sweep:
    """The calibration sweep's state: the engine's step records as they come, and whether each step was
    followed at once by the next."""

    def __init__(self, seed: int, decode_tokens: int) -> None:
        from tokenloop.request import SamplingParams

        self.records: list[Any] = []
        self.direct: list[bool] = []  # whether the record's step was followed at once by the next one
        self.rng = random.Random(seed)
        self.params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
        self.engine: Any = None

    def prompt(self, length: int) -> list[int]:
        high = min(1000, self.engine.core.vocab_size)  # ids any vocabulary holds; no special meaning to them
        return [self.rng.randrange(10, high) for _ in range(length)]

    def run_until(self, done: Any) -> None:
        records, direct = self.records, self.direct
        while not done():
            before = len(records)
            self.engine.step()
            if len(records) > before:
                direct[len(direct):] = [True] * (len(records) - len(direct))
        if direct:
            direct[-1] = False  # requests are added next: the gap is the sweep's, not the loop's

    def warm_up(self) -> None:
        """One short request; its steps pay one-time costs and are dropped."""
        self.engine.add_request("warmup", None, self.params, prompt_token_ids=self.prompt(16))
        self.run_until(lambda: not self.engine.has_unfinished_requests())
        self.records.clear()
        self.direct.clear()

    def mixed(self, batch: int, contexts: Sequence[int], mixed_prompts: Sequence[int], token_budget: int) -> None:
        """`batch` requests decode while prompts of each of `mixed_prompts` tokens arrive one at a time."""
        from tokenloop.request import SamplingParams

        engine = self.engine
        # Long enough to outlast every arrival of this batch (each needs its chunks and two decodes).
        # (Some decode already while the others prefill, then two decode steps alone: 64 spare.)
        lasting = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64 + sum(
            3 + -(-p // max(1, token_budget - batch)) for p in mixed_prompts))
        background = [f"m{batch}-{i}" for i in range(batch)]
        for i, request_id in enumerate(background):
            engine.add_request(request_id, None, lasting, prompt_token_ids=self.prompt(contexts[i % len(contexts)]))
        self.run_until(lambda: engine.scheduler.num_waiting == 0 and all(
            r.num_output_tokens > 0 for r in engine.scheduler.running_requests()))
        decoded = len(self.records)
        self.run_until(lambda: len(self.records) >= decoded + 2)  # two pure decode steps of `batch` rows
        for length in mixed_prompts:
            arrival = f"m{batch}-p{length}"
            engine.add_request(arrival, None, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                               prompt_token_ids=self.prompt(length))
            self.run_until(lambda arrival=arrival: arrival not in {
                r.request_id for r in engine.scheduler.running_requests()} and engine.scheduler.num_waiting == 0)
        engine.abort_request(background)

    def periods(self) -> list[float]:
        """Each step's period: to the next step's start, or where the sweep added requests in between, its
        duration plus the loop's median gap between steps."""
        records, direct = self.records, self.direct
        gaps = [b.start_ns - a.end_ns for a, b, d in zip(records, records[1:], direct) if d]
        gap = float(statistics.median(gaps)) if gaps else 0.0
        return [((b.start_ns - a.start_ns) if d else (a.end_ns - a.start_ns + gap)) / 1e9
                for a, b, d in zip(records, [*records[1:], records[-1]], direct)]


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
