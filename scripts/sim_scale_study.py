"""The simulator's scale study: one trace through N simulated replicas, policies x routers, in parts.

`run` simulates a slice of the grid (some policies, some routers) and pickles its runs, so slices can run
as separate processes; `merge` reads the slices back and writes one HTML report (`tokenloop simulate`'s, with
its energy and router sections), the printed tables, and a small JSON of the numbers per cell.

    python scripts/sim_scale_study.py run --trace T.jsonl --policies fcfs,priority --routers round-robin,cost \
        --replicas 8 --time-scale 0.9 --out /tmp/part1.pkl
    python scripts/sim_scale_study.py merge /tmp/part1.pkl /tmp/part2.pkl --report grid.html --json grid.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from tokenloop.bench.policies import PolicyBenchResult
from tokenloop.bench.report import format_table, write_html
from tokenloop.bench.trace import load_trace
from tokenloop.cli.simulate import energy_table
from tokenloop.cli.simulate_cluster import (
    cluster_table,
    parse_routers,
    simulate_cluster,
)
from tokenloop.sim.profiles import load_profile


def run(args: argparse.Namespace) -> None:
    trace = load_trace(args.trace)[:args.requests]
    profile = load_profile(args.profile)
    options = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    policies = [p for p in args.policies.split(",") if p]
    routers = parse_routers(args.routers)
    began, began_cpu = time.perf_counter(), time.process_time()
    result, _ = simulate_cluster(trace, profile, policies, routers, args.replicas, options,
                                 time_scale=args.time_scale)
    # Cells are policy-major (simulate_cluster's order); the labels say both, whatever the slice.
    labels = [f"{policy}/{router}" for policy in policies for router in routers]
    for run_, label in zip(result.runs, labels):
        run_.label = label
    summaries = [dataclasses.replace(s, label=label) for s, label in zip(result.summaries, labels)]
    wall, cpu = time.perf_counter() - began, time.process_time() - began_cpu
    print(f"{len(trace)} requests x {len(result.runs)} cells on {args.replicas} replicas: wall {wall:.1f} s, "
          f"cpu {cpu:.1f} s; per cell (wall s): {[round(r.wall_s, 1) for r in result.runs]}")
    settings = {"trace": args.trace, "requests": len(trace), "profile": profile.name, "replicas": args.replicas,
                "time_scale": args.time_scale, **options}
    with open(args.out, "wb") as f:
        pickle.dump({"runs": result.runs, "summaries": summaries, "settings": settings,
                     "wall_s": wall, "cpu_s": cpu, "policies": policies}, f)


def cell_numbers(run_: Any, summary: Any) -> dict[str, Any]:
    ttfts = [r.ttft_s for r in run_.records if r.success and r.ttft_s is not None]
    itls = [gap for r in run_.records if r.success for gap in r.itls_s]
    energy = run_.settings.get("energy_per_request") or {}
    return {
        "label": run_.label, "router": run_.settings.get("router"),
        "ttft_p50_ms": float(np.percentile(ttfts, 50)) * 1e3, "ttft_p90_ms": float(np.percentile(ttfts, 90)) * 1e3,
        "ttft_p99_ms": float(np.percentile(ttfts, 99)) * 1e3,
        "itl_mean_ms": float(np.mean(itls)) * 1e3, "itl_p90_ms": float(np.percentile(itls, 90)) * 1e3,
        "output_tok_s": summary.overall.output_throughput, "req_s": summary.overall.request_throughput,
        "completed": summary.overall.completed, "prefix_hit_rate": run_.prefix_cache_hit_rate,
        "preemptions": run_.num_preemptions, "energy_j_per_request_mean": energy.get("mean_j"),
        "energy_j_per_request_p90": energy.get("p90_j"), "energy_j_per_output_token": energy.get("j_per_output_token"),
        "ttft_p99_ms_by_priority": {str(p): g.latencies["ttft"].p99 for p, g in summary.by_priority.items()},
        "replay_wall_s": run_.wall_s, "num_steps": run_.num_steps,
        "requests_per_replica": [p["requests"] for p in run_.settings["per_replica"]],
    }


def merge(args: argparse.Namespace) -> None:
    parts = [pickle.loads(Path(p).read_bytes()) for p in args.parts]
    runs = [r for part in parts for r in part["runs"]]
    summaries = [s for part in parts for s in part["summaries"]]
    result = PolicyBenchResult(runs, summaries)
    print(format_table(summaries, False, title="Policies x routers"))
    print(cluster_table(result))
    energy = energy_table(runs)
    if energy:
        print(energy)
    settings = dict(parts[0]["settings"])
    settings["parts_wall_s"] = [round(part["wall_s"], 1) for part in parts]
    settings["parts_cpu_s"] = [round(part["cpu_s"], 1) for part in parts]
    if args.report:
        write_html(args.report, runs, summaries, title="tokenloop simulated scale study: policies x routers",
                   settings=settings)
        print(f"wrote {args.report}")
    if args.json:
        document = {"settings": settings, "cells": [cell_numbers(r, s) for r, s in zip(runs, summaries)]}
        Path(args.json).write_text(json.dumps(document, indent=1), encoding="utf-8")
        print(f"wrote {args.json}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    r = sub.add_parser("run")
    r.add_argument("--trace", required=True)
    r.add_argument("--requests", type=int, default=100_000)
    r.add_argument("--profile", default="h100-llama3-8b")
    r.add_argument("--policies", default="fcfs,priority,sjf,fair")
    r.add_argument("--routers", default="round-robin,least-load,cost")
    r.add_argument("--replicas", type=int, default=8)
    r.add_argument("--time-scale", type=float, default=1.0)
    r.add_argument("--max-num-seqs", type=int, default=256)
    r.add_argument("--max-num-batched-tokens", type=int, default=2048)
    r.add_argument("--out", required=True)
    m = sub.add_parser("merge")
    m.add_argument("parts", nargs="+")
    m.add_argument("--report")
    m.add_argument("--json")
    args = parser.parse_args()
    run(args) if args.action == "run" else merge(args)


if __name__ == "__main__":
    main()
