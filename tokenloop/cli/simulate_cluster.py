"""`tokenloop simulate --replicas N --router R[,R...]`: one trace through N simulated replicas per router.

Every router sees the same trace, the same replicas (engine options, profile) and the same policy; the
routers (`tokenloop.cluster`) read a `LoadTracker` fed by the simulated cores' own outputs, KV events
included (`tokenloop.sim.cluster`). The results are `bench policies`' runs (one column per router), so
the table, the HTML report and `--save-result` are the same; a second table adds what a cluster adds:
p90 TTFT, the prefix hit rate and the requests of each replica, and how far the cost router's
predicted TTFT was from the simulated one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenloop.cli.simulate_runs import profile_options, run_costs
from tokenloop.request import FinishReason


def parse_routers(text: str) -> tuple[str, ...]:
    """'round-robin,cost' -> ('round-robin', 'cost'); ValueError naming an unknown router."""
    from tokenloop.cluster.router import ROUTERS

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in ROUTERS]
    if unknown or not names:
        raise ValueError(f"unknown router {unknown[0] if unknown else text!r} (valid: {', '.join(ROUTERS)})")
    if len(set(names)) != len(names):
        raise ValueError(f"a router is listed twice in {text!r}")
    return names


def simulate_cluster(trace: Sequence[Any], profile: Any, policies: Sequence[str], routers: Sequence[str],
                     num_replicas: int, options: dict[str, Any], *, time_scale: float = 1.0,
                     slos_ms: dict[str, float] | None = None) -> tuple[Any, Any]:
    """One cluster replay per (policy, router): (PolicyBenchResult, PolicyBenchConfig)."""
    from tokenloop.bench.policies import PolicyBenchConfig, PolicyBenchResult
    from tokenloop.bench.replay import SIMULATED_CLOCK
    from tokenloop.bench.report import summarize_run
    from tokenloop.llm import build_engine_config

    options, vocab_size = profile_options(profile, options, trace)
    labels = [r if len(policies) == 1 else f"{p}/{r}" for p in policies for r in routers]
    config = PolicyBenchConfig(policies=tuple(labels), model=profile.model,
                               engine_options={**options, "replicas": num_replicas}, clock=SIMULATED_CLOCK,
                               time_scale=time_scale, slos_ms=slos_ms or {}, progress=False, warmup=False)
    runs = []
    for policy in policies:
        engine_config = build_engine_config(profile.model, policy=policy, enable_kv_events=True, **options)
        for router in routers:
            label = labels[len(runs)]
            runs.append(_replay(trace, profile, engine_config, router, num_replicas, vocab_size, label,
                                time_scale))
    return PolicyBenchResult(runs, [summarize_run(run, slos_ms or None) for run in runs]), config


def _replay(trace: Sequence[Any], profile: Any, engine_config: Any, router_name: str, num_replicas: int,
            vocab_size: int, label: str, time_scale: float) -> Any:
    from tokenloop.bench.replay import SIMULATED_CLOCK, ReplayRun
    from tokenloop.cluster.router import RouteDecision, RouteRequest
    from tokenloop.request import NS_PER_S
    from tokenloop.sim.cluster import SimRequest, SimulatedCluster
    from tokenloop.sim.energy import StepEnergy, attach_energy, energy_summary

    cluster = SimulatedCluster(num_replicas, engine_config, profile.cost_model, vocab_size=vocab_size,
                               max_model_len=profile.max_model_len, kv_bytes_per_token=profile.kv_bytes_per_token)
    energy = StepEnergy(profile.power_watts) if profile.power_watts is not None else None
    if energy is not None:  # one observer for all replicas: request ids are unique across the cluster
        for engine in cluster.engines:
            engine.add_observer(energy)
    dispatcher = _dispatcher(profile, engine_config, router_name, num_replicas, cluster.now_ns)
    decisions: dict[str, RouteDecision] = {}

    def route(request: SimRequest, now_ns: int) -> int:
        decision = dispatcher.dispatch(RouteRequest(request.request_id, list(request.prompt_token_ids),
                                                    request.cache_salt, request.session))
        decisions[request.request_id] = decision
        return decision.replica

    requests = [SimRequest(r.id, int(round(r.arrival_s * time_scale * NS_PER_S)), tuple(r.prompt_tokens),
                           r.max_tokens, r.priority, r.user) for r in trace]
    result = cluster.run(requests, route, dispatcher.tracker.on_frame)
    records = _records(trace, requests, result)
    attach_energy(records, energy)
    replicas = result.replicas
    run = ReplayRun(label=label, kind="engine", records=records,
                    num_preemptions=sum(r.num_preemptions for r in replicas),
                    prefix_cache_queries=sum(r.prefix_cache_queries for r in replicas),
                    prefix_cache_hits=sum(r.prefix_cache_hits for r in replicas),
                    num_steps=result.num_steps, wall_s=result.wall_s)
    predicted = {rid: d.predicted_ttft_s for rid, d in decisions.items() if d.predicted_ttft_s is not None}
    run.settings = {
        "clock": SIMULATED_CLOCK, "time_scale": time_scale, "profile": profile.name, "router": router_name,
        "replicas": num_replicas,
        "per_replica": [{"index": r.index, "requests": r.num_requests, "steps": r.num_steps,
                         "preemptions": r.num_preemptions, "prefix_cache_hit_rate": r.prefix_cache_hit_rate,
                         "modelled_busy_s": r.modelled_busy_s} for r in replicas],
        "route": {rid: [d.replica, d.cached_tokens, d.predicted_ttft_s] for rid, d in decisions.items()},
        "ttft_prediction_mae_ms": _prediction_error_ms(records, predicted),
        **run_costs([engine.runner for engine in cluster.engines], profile,
                     sum(r.output_len for r in records)),
    }
    if energy is not None:
        run.settings["energy_per_request"] = energy_summary(records)
    return run


def _dispatcher(profile: Any, engine_config: Any, router_name: str, num_replicas: int, clock: Any) -> Any:
    """The router behind a load tracker that starts from the profile's costs (the hardware is known) and refits
    them from the steps."""
    from tokenloop.cluster.load import LoadTracker
    from tokenloop.cluster.router import Dispatcher, RouterConfig, make_router
    from tokenloop.cluster.step_costs import StepCosts

    block_size = engine_config.cache.block_size
    tracker = LoadTracker(num_replicas, block_size, seed_costs=StepCosts.from_cost_model(profile.cost_model),
                          clock=clock)
    router = make_router(router_name, RouterConfig(
        block_size=block_size, max_num_batched_tokens=engine_config.scheduler.max_num_batched_tokens,
        max_num_seqs=engine_config.scheduler.max_num_seqs))
    return Dispatcher(router, tracker)


def _records(trace: Sequence[Any], requests: Sequence[Any], result: Any) -> list[Any]:
    """Each trace request's record from the cluster's outputs (or its error)."""
    from tokenloop.bench.replay import fill_from_output, new_record
    from tokenloop.request import NS_PER_S

    records = []
    for request, sim in zip(trace, requests):
        record = new_record(request, sim.arrival_ns / NS_PER_S)
        if request.id in result.errors:
            record.error, record.finish_reason = result.errors[request.id], FinishReason.ERROR
        elif request.id in result.outputs:
            fill_from_output(record, result.outputs[request.id][1], 0.0)
        records.append(record)
    return records


def _prediction_error_ms(records: Sequence[Any], predicted: dict[str, float]) -> float | None:
    errors = [abs(predicted[r.id] - r.ttft_s) for r in records if r.id in predicted and r.ttft_s is not None]
    return float(np.mean(errors)) * 1e3 if errors else None


def cluster_table(result: Any) -> str:
    """What a cluster adds to the comparison: p90 TTFT, hit rates and requests per replica."""
    from tokenloop.bench.report import _fmt, format_rows

    runs = result.runs

    def ttft_ms(run: Any, q: float) -> float | None:
        values = [r.ttft_s for r in run.records if r.success and r.ttft_s is not None]
        return float(np.percentile(values, q)) * 1e3 if values else None

    rows: list[tuple[str, list[str]]] = [
        ("P50 TTFT (ms)", [_fmt(ttft_ms(run, 50)) for run in runs]),
        ("P90 TTFT (ms)", [_fmt(ttft_ms(run, 90)) for run in runs]),
        ("Mean ITL (ms)", [_fmt(s.overall.latencies["itl"].mean) for s in result.summaries]),
        ("Output token throughput (tok/s)", [_fmt(s.overall.output_throughput) for s in result.summaries]),
        ("Prefix cache hit rate (%)", [_fmt(None if run.prefix_cache_hit_rate is None
                                            else 100 * run.prefix_cache_hit_rate) for run in runs]),
        ("Predicted TTFT mean abs error (ms)", [_fmt(run.settings.get("ttft_prediction_mae_ms")) for run in runs]),
    ]
    num_replicas = runs[0].settings["replicas"]
    for index in range(num_replicas):
        rows.append((f"replica {index}", []))
        per = [run.settings["per_replica"][index] for run in runs]
        rows.append(("Requests", [_fmt(p["requests"]) for p in per]))
        rows.append(("Prefix cache hit rate (%)", [_fmt(None if p["prefix_cache_hit_rate"] is None
                                                        else 100 * p["prefix_cache_hit_rate"]) for p in per]))
        rows.append(("Modelled busy time (s)", [_fmt(p["modelled_busy_s"]) for p in per]))
    return format_rows(f"Routers on {num_replicas} replicas", [run.label for run in runs], rows)
