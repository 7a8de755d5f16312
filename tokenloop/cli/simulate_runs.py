"""Simulated replays of a trace under a profile: what `tokenloop simulate` and its cluster and validate
commands share (below all three, so none of them imports another for it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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

    options, vocab_size = profile_options(profile, options, trace)
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
        run.settings.update(profile=profile.name, **run_costs([built[-1].runner], profile,
                                                               sum(r.output_len for r in run.records)))
        if energy is not None:
            run.settings["energy_per_request"] = energy_summary(run.records)
        runs.append(run)
    return PolicyBenchResult(runs, [summarize_run(run, slos_ms or None) for run in runs]), config


def profile_options(profile: Any, options: dict[str, Any], trace: Sequence[Any]) -> tuple[dict[str, Any], int]:
    """The engine options completed from the profile, and the simulated vocabulary the trace needs."""
    from tokenloop.sim.profiles import check_profile_fits

    # Step costs were measured (or derived) with the profile's blocks; another size is another engine.
    check_profile_fits(profile, block_size=options.get("block_size"))
    options = {"block_size": profile.block_size, **options}
    if "num_blocks" not in options and profile.kv_cache_memory_bytes:
        options["kv_cache_memory_bytes"] = profile.kv_cache_memory_bytes
    # The top two ids are the simulator's filler and EOS tokens: above every prompt id.
    return options, max(max(r.prompt_tokens) for r in trace) + 3


def run_costs(runners: Sequence[Any], profile: Any, num_output_tokens: int) -> dict[str, Any]:
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
