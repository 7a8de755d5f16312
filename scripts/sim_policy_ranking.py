"""Re-run BENCHMARKS.md's policy comparison in simulation and check whether the policies rank the same way.

    python -m tokenloop bench make-trace --out trace.jsonl ...   # the command of that section
    python scripts/sim_policy_ranking.py --trace trace.jsonl --profile cpu-smollm2-135m

The real table ("Scheduling policies on one fixed trace") is quoted below as data; each of its rows is
ranked (ascending) over fcfs, priority, sjf and fair, and compared with the same row of the simulation
with the same engine options (160 KV blocks, max_num_seqs 16, max_num_batched_tokens 512).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

POLICIES = ("fcfs", "priority", "sjf", "fair")
# BENCHMARKS.md, "Scheduling policies on one fixed trace (issue: Benchmark harness)": one value per policy.
REAL = {
    "duration (s)": (138.0, 135.4, 137.2, 147.6),
    "output tok/s": (61.6, 62.8, 62.0, 57.6),
    "mean TTFT (s)": (35.2, 35.1, 36.8, 42.3),
    "p50 TTFT (s)": (35.2, 31.5, 36.9, 41.7),
    "p99 TTFT (s)": (76.3, 77.9, 79.8, 89.0),
    "mean queue wait (s)": (34.5, 34.4, 36.1, 41.5),
    "mean ITL (ms)": (184, 178, 183, 202),
    "p99 ITL (ms)": (1002, 970, 929, 937),
    "preemptions": (37, 42, 54, 47),
    "prefix hit rate (%)": (16.7, 18.6, 11.9, 13.3),
    "priority 0: mean TTFT (s)": (40.4, 21.4, 41.6, 47.8),
    "priority 0: p50 TTFT (s)": (44.8, 14.5, 42.5, 47.0),
    "priority 1: mean TTFT (s)": (32.4, 42.6, 34.2, 39.2),
    "priority 1: p50 TTFT (s)": (28.6, 41.5, 28.2, 35.5),
    "user-0: mean TTFT (s)": (37.3, 37.0, 39.0, 60.8),
    "user-1: mean TTFT (s)": (36.5, 33.8, 36.9, 27.9),
    "user-2: mean TTFT (s)": (29.3, 29.4, 31.7, 28.7),
    "user-3: mean TTFT (s)": (32.9, 38.7, 35.4, 15.4),
}
ENGINE = {"num_blocks": 160, "max_num_seqs": 16, "max_num_batched_tokens": 512}


def simulated_rows(result: Any) -> dict[str, tuple[float, ...]]:
    """The real table's rows from a simulated PolicyBenchResult (policies in POLICIES order)."""
    runs = {run.label: run for run in result.runs}
    summaries = {s.label: s for s in result.summaries}

    def per_policy(value: Any) -> tuple[float, ...]:
        return tuple(float(value(runs[p], summaries[p])) for p in POLICIES)

    def ttft_s(run: Any, q: float, keep: Any = lambda r: True) -> float:
        values = [r.ttft_s for r in run.records if r.success and r.ttft_s is not None and keep(r)]
        return float(np.percentile(values, q)) if q else float(np.mean(values))

    rows = {
        "duration (s)": per_policy(lambda r, s: s.duration_s),
        "output tok/s": per_policy(lambda r, s: s.overall.output_throughput),
        "mean TTFT (s)": per_policy(lambda r, s: ttft_s(r, 0)),
        "p50 TTFT (s)": per_policy(lambda r, s: ttft_s(r, 50)),
        "p99 TTFT (s)": per_policy(lambda r, s: ttft_s(r, 99)),
        "mean queue wait (s)": per_policy(lambda r, s: s.overall.latencies["queue_wait"].mean / 1e3),
        "mean ITL (ms)": per_policy(lambda r, s: s.overall.latencies["itl"].mean),
        "p99 ITL (ms)": per_policy(lambda r, s: s.overall.latencies["itl"].p99),
        "preemptions": per_policy(lambda r, s: r.num_preemptions),
        "prefix hit rate (%)": per_policy(lambda r, s: 100 * r.prefix_cache_hit_rate),
    }
    for priority in (0, 1):
        rows[f"priority {priority}: mean TTFT (s)"] = per_policy(
            lambda r, s, p=priority: ttft_s(r, 0, lambda x: x.priority == p))
        rows[f"priority {priority}: p50 TTFT (s)"] = per_policy(
            lambda r, s, p=priority: ttft_s(r, 50, lambda x: x.priority == p))
    for user in range(4):
        rows[f"user-{user}: mean TTFT (s)"] = per_policy(
            lambda r, s, u=f"user-{user}": ttft_s(r, 0, lambda x: x.user == u))
    return rows


def order(values: tuple[float, ...]) -> tuple[str, ...]:
    """Policies from the smallest value to the largest (ties by POLICIES order)."""
    return tuple(POLICIES[i] for i in sorted(range(len(values)), key=lambda i: (values[i], i)))


def kendall_tau(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    pairs = list(itertools.combinations(range(len(a)), 2))
    score = sum(np.sign(a[i] - a[j]) * np.sign(b[i] - b[j]) for i, j in pairs)
    return float(score) / len(pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--profile", default="cpu-smollm2-135m")
    parser.add_argument("--save-result", help="write the rows, orders and verdicts as JSON")
    args = parser.parse_args(argv)

    from tokenloop.bench.trace import load_trace
    from tokenloop.cli.simulate_runs import simulate_trace
    from tokenloop.sim.profiles import load_profile

    profile = load_profile(args.profile)
    result, _ = simulate_trace(load_trace(args.trace), profile, POLICIES, dict(ENGINE))
    sim = simulated_rows(result)
    print(f"profile {profile.name}; columns {', '.join(POLICIES)}; order = smallest first\n")
    print("| row | real | simulated | real order | simulated order | same order | Kendall tau |")
    print("| --- | --- | --- | --- | --- | --- | ---: |")
    verdicts = {}
    for row, real in REAL.items():
        same = order(real) == order(sim[row])
        tau = kendall_tau(real, sim[row])
        verdicts[row] = {"real": real, "simulated": sim[row], "real_order": order(real),
                         "simulated_order": order(sim[row]), "same_order": same, "kendall_tau": tau}
        print(f"| {row} | {' / '.join(f'{v:g}' for v in real)} | {' / '.join(f'{v:.3g}' for v in sim[row])} | "
              f"{' < '.join(order(real))} | {' < '.join(order(sim[row]))} | {'yes' if same else 'no'} | "
              f"{tau:+.2f} |")
    matched = sum(v["same_order"] for v in verdicts.values())
    best_matched = sum(v["real_order"][0] == v["simulated_order"][0] for v in verdicts.values())
    print(f"\nsame order on {matched} of {len(REAL)} rows; same best (smallest) policy on {best_matched}; "
          f"mean Kendall tau {np.mean([v['kendall_tau'] for v in verdicts.values()]):+.2f}")
    if args.save_result:
        Path(args.save_result).write_text(json.dumps({"profile": profile.name, "rows": verdicts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
