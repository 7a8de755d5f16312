"""`bench cluster`: one trace, the same replicas, each router in turn; routing quality side by side.

For each router a fresh `tokenloop serve --replicas N --router R` starts (so no router inherits another's
warm prefix caches), the trace is replayed against it at its own arrival times, and the server's
`/metrics` afterwards give each replica's prefix-cache hits and generated tokens. The table shows per
router: prefix hit rate, TTFT p50 / p90, output throughput, and how the work spread over the replicas.

On a 2-core machine the replicas share the cores, so this measures routing quality (hit rate, queueing)
and correctness, not a cluster's speed-up; the simulator (`tokenloop simulate --replicas`) does scale.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenloop.bench.metrics import BenchmarkMetrics, compute_metrics
from tokenloop.bench.serve import ClientConfig, run_requests
from tokenloop.bench.server_process import served
from tokenloop.bench.trace import TraceRequest

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class ClusterBenchConfig:
    """What stays fixed across routers: the model, the replicas, the server's other options."""

    model: str
    replicas: int = 2
    routers: tuple[str, ...] = ("round-robin", "least-load", "cost")
    cluster: str = "local"
    serve_args: tuple[str, ...] = ()  # more `tokenloop serve` flags (engine options), the same for all
    endpoint: str = "/v1/completions"
    time_scale: float = 1.0
    runs: int = 1  # servers per router: the spread tells the noise from the difference
    progress: bool = False


@dataclass
class ReplicaShare:
    replica: int
    prefix_cache_queries: float
    prefix_cache_hits: float
    generation_tokens: float

    @property
    def hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class RouterRun:
    """One router on one fresh server."""

    router: str
    metrics: BenchmarkMetrics
    replicas: list[ReplicaShare]
    handoffs: dict[str, float] = field(default_factory=dict)

    @property
    def prefix_hit_rate(self) -> float:
        queries = sum(r.prefix_cache_queries for r in self.replicas)
        return sum(r.prefix_cache_hits for r in self.replicas) / queries if queries else 0.0

    @property
    def spread(self) -> list[float]:
        """Each replica's share of the generated tokens."""
        total = sum(r.generation_tokens for r in self.replicas) or 1.0
        return [r.generation_tokens / total for r in self.replicas]


def replica_shares(metrics_text: str) -> list[ReplicaShare]:
    """Per replica, the prefix-cache counters and generated tokens from a server's /metrics."""
    values: dict[int, dict[str, float]] = {}
    wanted = {"tokenloop:prefix_cache_queries": "queries", "tokenloop:prefix_cache_hits": "hits",
              "tokenloop:generation_tokens": "tokens"}
    for family in text_string_to_metric_families(metrics_text):
        key = wanted.get(family.name)
        if key is None:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total") or "replica" not in sample.labels:
                continue
            values.setdefault(int(sample.labels["replica"]), {})[key] = sample.value
    return [ReplicaShare(i, v.get("queries", 0.0), v.get("hits", 0.0), v.get("tokens", 0.0))
            for i, v in sorted(values.items())]


def run_router(trace: Sequence[TraceRequest], router: str, config: ClusterBenchConfig, workdir: Path) -> RouterRun:
    serve_args = ["--model", config.model, "--replicas", str(config.replicas), "--router", router,
                  "--cluster", config.cluster, "--no-trace", "--log-level", "warning", *config.serve_args]
    offsets = [r.arrival_s * config.time_scale for r in trace]
    with served(serve_args, workdir / f"serve-{router}.log", name=f"server ({router})") as base_url:
        client_config = ClientConfig(base_url=base_url, endpoint=config.endpoint)
        records, duration = asyncio.run(run_requests(trace, offsets, client_config, progress=config.progress,
                                                     desc=router))
        text = httpx.get(f"{base_url}/metrics", timeout=10.0).text
    handoffs = {s.labels.get("outcome", ""): s.value for family in text_string_to_metric_families(text)
                if family.name == "tokenloop:handoffs" for s in family.samples if s.name.endswith("_total")}
    failed = [r.error for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{router}: {len(failed)} of {len(records)} requests failed; first: {failed[0]}")
    return RouterRun(router, compute_metrics(records, duration, percentiles=PERCENTILES), replica_shares(text),
                     handoffs)


def run_cluster_bench(trace: Sequence[TraceRequest], config: ClusterBenchConfig) -> dict[str, list[RouterRun]]:
    """Every router, `config.runs` times each, interleaved (router A, B, C, A, B, C: drift hits all alike)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the table
    results: dict[str, list[RouterRun]] = {r: [] for r in config.routers}
    with tempfile.TemporaryDirectory(prefix="tokenloop-bench-cluster-") as tmp:
        for _ in range(config.runs):
            for router in config.routers:
                results[router].append(run_router(trace, router, config, Path(tmp)))
    return results


def _mean_spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f}"


def format_table(results: dict[str, list[RouterRun]]) -> str:
    header = (f"{'router':<12} {'prefix hit':>10} {'TTFT p50 ms':>14} {'TTFT p90 ms':>14} {'out tok/s':>12} "
              f"{'tokens per replica':>22}")
    lines = [header, "-" * len(header)]
    for router, runs in results.items():
        hit = _mean_spread([100 * r.prefix_hit_rate for r in runs]) + " %"
        p50 = _mean_spread([r.metrics.ttft.percentile(50) for r in runs])
        p90 = _mean_spread([r.metrics.ttft.percentile(90) for r in runs])
        tput = _mean_spread([r.metrics.output_throughput for r in runs])
        shares = " / ".join(f"{100 * s:.0f}%" for s in runs[-1].spread)
        lines.append(f"{router:<12} {hit:>10} {p50:>14} {p90:>14} {tput:>12} {shares:>22}")
    return "\n".join(lines)


def result_json(results: dict[str, list[RouterRun]], config: ClusterBenchConfig) -> dict[str, Any]:
    return {"config": {"model": config.model, "replicas": config.replicas, "cluster": config.cluster,
                       "serve_args": list(config.serve_args), "time_scale": config.time_scale, "runs": config.runs},
            "routers": {router: [{
                "prefix_hit_rate": r.prefix_hit_rate,
                "ttft_ms": {str(p): r.metrics.ttft.percentile(p) for p in PERCENTILES},
                "ttft_mean_ms": r.metrics.ttft.mean_ms, "itl_mean_ms": r.metrics.itl.mean_ms,
                "output_throughput": r.metrics.output_throughput, "duration_s": r.metrics.duration_s,
                "replicas": [{"replica": s.replica, "hit_rate": s.hit_rate, "generation_tokens": s.generation_tokens}
                             for s in r.replicas],
                "handoffs": r.handoffs} for r in runs] for router, runs in results.items()}}


def save(results: dict[str, list[RouterRun]], config: ClusterBenchConfig, path: str) -> None:
    Path(path).write_text(json.dumps(result_json(results, config), indent=1), encoding="utf-8")
