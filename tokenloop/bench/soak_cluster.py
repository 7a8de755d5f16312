"""Soak with everything at once, against a real `tokenloop serve --replicas 2 --failover recompute`.

    python -m tokenloop.bench.soak_cluster --num-requests 300 --concurrency 12

One run mixes ordinary traffic (chat and completions, streaming and not, n=1/2, logprobs, stop strings),
hostile requests (`--hostile-fraction`, default 5%: malformed bodies and hostile constraints, each must get a
4xx, constraints one naming their field), valid structured outputs (JSON schema, regex, choice: a 200 and
an output that obeys them), client disconnects, long prompts (thousands of tokens), and two injected faults
on the replicas' engine cores: a hang (SIGSTOP past the heartbeat bound `--hang-timeout`; the server must
kill the replica, resume its requests elsewhere and restart it) and a kill (SIGKILL).

The server is started as a child process on 127.0.0.1 and stopped at the end. The report counts completed
requests, rejections by status, hostile requests failed by their own fault, collateral failures (a
well-behaved request that failed: goal 0, each listed with whether it overlapped a fault), KV blocks still
referenced per replica after the run (goal 0), p50/p99 latency of well-behaved requests, and each fault's
recovery times. Exit status 1 on a violation.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tokenloop.bench.server_process import served_process
from tokenloop.bench.soak import SoakConfig, SoakReport, _Plan, _plan, _run_one
from tokenloop.bench.soak_faults import POLL_S, FaultRecord, inject, replica_metric, replicas, watch_first_token
from tokenloop.bench.soak_mix import (
    HOSTILE_CONSTRAINTS,
    STRUCTURED_REQUESTS,
    HostileConstraint,
    StructuredRequest,
    long_prompt,
    run_hostile_constraint,
    run_structured,
)
from tokenloop.model.loader import DEFAULT_MODEL

WELL_BEHAVED = ("ordinary", "structured", "long")


@dataclass
class ClusterSoakConfig:
    """What to mix, how much of it, and the faults' places in the run."""

    model: str = DEFAULT_MODEL
    num_requests: int = 300
    concurrency: int = 12
    max_tokens: int = 24
    seed: int = 0
    disconnect_fraction: float = 0.15
    hostile_fraction: float = 0.05
    structured_fraction: float = 0.10
    long_fraction: float = 0.03
    long_prompt_words: int = 2500  # ~3,500 tokens with SmolLM2's tokenizer
    hang_timeout_s: float = 5.0
    hang_at: float = 0.2  # the hang goes when this share of the requests have ended ...
    kill_at: float = 0.55  # ... and the kill at this share (after the hang's recovery)
    inject_faults: bool = True
    recovery_timeout_s: float = 300.0
    idle_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    serve_args: list[str] = field(default_factory=list)  # more `tokenloop serve` flags
    log: Path | None = None


@dataclass
class Collateral:
    """A well-behaved request that failed."""

    kind: str
    began: float
    ended: float
    what: str
    during_fault: bool = False


@dataclass
class ClusterSoakReport(SoakReport):
    """The soak's counts plus the faults' recoveries, the collateral failures and per-replica KV usage."""

    faults: list[FaultRecord] = field(default_factory=list)
    collateral: list[Collateral] = field(default_factory=list)
    long_latencies_s: list[float] = field(default_factory=list)
    requests_sent: int = 0
    kinds: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        lines = [super().summary().rsplit("\n  result:", 1)[0]]
        if self.long_latencies_s:
            ordered = sorted(self.long_latencies_s)
            lines.append(f"  long prompts completed: {len(ordered)}, latency p50 "
                         f"{ordered[len(ordered) // 2]:.2f} s, max {ordered[-1]:.2f} s")
        rejected = {k: v for k, v in self.outcomes.items() if k.startswith("rejected_")}
        lines.append("  kinds: " + ", ".join(f"{k}={v}" for k, v in sorted(self.kinds.items())))
        lines.append(f"  requests sent: {self.requests_sent}; rejected by status: {rejected or 'none'}; "
                     f"failed by "
                     f"their own fault (hostile): {self.outcomes['failed_by_own_fault']}")
        during = sum(c.during_fault for c in self.collateral)
        lines.append(f"  collateral failures: {len(self.collateral)} ({during} overlapping a fault window)")
        lines.extend(f"    {c.kind} at +{c.began:.1f}..{c.ended:.1f} s"
                     f"{' (during a fault)' if c.during_fault else ''}: {c.what}"
                     for c in self.collateral[:20])
        lines.extend(f"  fault: {f.describe()}" for f in self.faults)
        lines.append("  result: " + ("PASS" if self.ok else "FAIL"))
        lines.extend(f"  violation: {v}" for v in self.violations)
        return "\n".join(lines)


@dataclass
class _Item:
    """One client's request: which kind, and what it sends."""

    kind: str  # ordinary, long, structured, hostile_body, hostile_constraint
    plan: _Plan | None = None
    constraint: HostileConstraint | None = None
    structured: StructuredRequest | None = None


def _draw(rng: random.Random, config: ClusterSoakConfig, index: int) -> _Item:
    ordinary = SoakConfig(max_tokens=config.max_tokens, disconnect_fraction=config.disconnect_fraction)
    roll = rng.random()
    if roll < config.hostile_fraction:
        if rng.random() < 0.5:
            return _Item("hostile_constraint", constraint=rng.choice(HOSTILE_CONSTRAINTS))
        hostile = SoakConfig(hostile_fraction=1.0)
        return _Item("hostile_body", plan=_plan(rng, hostile, index))
    roll -= config.hostile_fraction
    if roll < config.structured_fraction:
        return _Item("structured", structured=rng.choice(STRUCTURED_REQUESTS))
    roll -= config.structured_fraction
    if roll < config.long_fraction:
        stream = rng.random() < 0.5
        body: dict[str, Any] = {"prompt": long_prompt(rng, index, config.long_prompt_words), "max_tokens": 8,
                                "temperature": 0.0, **({"stream": True} if stream else {})}
        return _Item("long", plan=_Plan(False, stream, body, None, None))
    return _Item("ordinary", plan=_plan(rng, ordinary, index))


def _merge(into: SoakReport, sub: SoakReport) -> None:
    into.outcomes.update(sub.outcomes)
    into.finish_reasons.update(sub.finish_reasons)
    into.completion_tokens += sub.completion_tokens


async def _run_item(client: httpx.AsyncClient, item: _Item, report: ClusterSoakReport, start: float) -> None:
    sub = SoakReport()
    began = time.monotonic()
    try:
        if item.constraint is not None:
            await run_hostile_constraint(client, item.constraint, sub)
        elif item.structured is not None:
            await run_structured(client, item.structured, sub)
        else:
            assert item.plan is not None
            await _run_one(client, item.plan, sub)
    except httpx.HTTPError as exc:  # _run_one counts its own; the others' land here
        sub.outcomes["client_error"] += 1
        sub.violations.append(f"transport error {type(exc).__name__}: {exc}")
    ended = time.monotonic()
    _merge(report, sub)
    report.kinds[item.kind] += 1
    if item.kind == "hostile_body" and not sub.violations:
        report.outcomes["failed_by_own_fault"] += 1
    if item.kind not in WELL_BEHAVED:
        report.violations.extend(sub.violations)
        return
    if sub.violations:
        during = any(a <= ended and began <= b for a, b in (f.window for f in report.faults))
        report.collateral.append(Collateral(item.kind, began - start, ended - start, sub.violations[0],
                                            during))
        return
    (report.long_latencies_s if item.kind == "long" else report.latencies_s).extend(sub.latencies_s)


async def _drive(config: ClusterSoakConfig, url: str, server_pid: int, report: ClusterSoakReport) -> None:
    rng = random.Random(config.seed)
    start = time.monotonic()
    transport = httpx.AsyncHTTPTransport(retries=0)
    limits = httpx.Limits(max_connections=config.concurrency + 8,
                          max_keepalive_connections=config.concurrency)
    ended = 0
    faults_done = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=config.request_timeout_s, transport=transport,
                                 limits=limits) as client, httpx.AsyncClient(base_url=url) as admin:

        async def client_loop() -> None:
            nonlocal ended
            # Past num_requests the traffic goes on until the faults' recoveries have been seen.
            while report.requests_sent < config.num_requests or not faults_done.is_set():
                item = _draw(rng, config, report.requests_sent)
                report.requests_sent += 1
                await _run_item(client, item, report, start)
                ended += 1

        watchers: list[asyncio.Task[None]] = []

        async def faults() -> None:
            try:
                plan = ((("hang", 0, config.hang_at), ("kill", 1, config.kill_at)) if config.inject_faults
                        else ())
                for kind, replica, share in plan:
                    while ended < share * config.num_requests:
                        await asyncio.sleep(POLL_S)
                    record = await inject(admin, kind, replica, server_pid, config.recovery_timeout_s,
                                          report.faults)
                    if record.alive_after_s is None:
                        break
                    watchers.append(asyncio.create_task(watch_first_token(admin, record)))
            except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is a finding
                report.violations.append(f"fault injection failed: {type(exc).__name__}: {exc}")
            finally:
                faults_done.set()

        await asyncio.gather(faults(), *(client_loop() for _ in range(config.concurrency)))
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)


async def _probe_each_replica(url: str, report: ClusterSoakReport) -> None:
    """After the traffic: each replica in turn serves a short request while the others are drained, so each
    one is seen serving (a restarted one too), and each one's gauges come from a step of its current core."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        count = len(await replicas(client))
        for index in range(count):
            others = [i for i in range(count) if i != index]
            for other in others:
                (await client.post(f"/admin/replicas/{other}/drain")).raise_for_status()
            try:
                r = await client.post("/v1/completions", json={"prompt": f"Probe {index}:", "max_tokens": 2})
                report.engine[f"probe_replica_{index}"] = r.status_code
                if r.status_code != 200:
                    report.violations.append(f"replica {index} alone answered HTTP {r.status_code}: "
                                             f"{r.text[:200]}")
            finally:
                for other in others:
                    (await client.post(f"/admin/replicas/{other}/undrain")).raise_for_status()


def _check_settled(url: str, config: ClusterSoakConfig, report: ClusterSoakReport) -> None:
    """Wait for the cluster to go idle; then nothing may run, hold a KV block, or be dead."""
    deadline = time.monotonic() + config.idle_timeout_s
    while True:
        text = httpx.get(url + "/metrics", timeout=30).text
        busy = {k: v for name in ("tokenloop:num_requests_running", "tokenloop:num_requests_waiting")
                for k, v in replica_metric(text, name).items() if v}
        usage = replica_metric(text, "tokenloop:kv_cache_usage_perc")
        rows = asyncio.run(_rows(url))
        settled = not busy and not any(usage.values()) and all(r["alive"] for r in rows)
        if settled or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    report.engine.update({
        "kv_cache_usage_perc": dict(sorted(usage.items())),
        "generated_tokens": sum(replica_metric(text, "tokenloop:generation_tokens_total").values()),
        "preemptions": sum(replica_metric(text, "tokenloop:num_preemptions_total").values()),
        "replicas": [{k: r[k] for k in ("index", "alive", "restarts", "death")} for r in rows]})
    if busy:
        report.violations.append(f"requests still running or waiting after the run, by replica: {busy}")
    for replica, value in usage.items():
        if value:
            report.violations.append(f"replica {replica}: KV blocks still referenced after the run "
                                     f"(usage {value})")
    for row in rows:
        if not row["alive"]:
            report.violations.append(f"replica {row['index']} is not alive after the run: {row['death']}")


async def _rows(url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url) as admin:
        return await replicas(admin)


def _judge(config: ClusterSoakConfig, report: ClusterSoakReport) -> None:
    if report.collateral:
        report.violations.append(f"{len(report.collateral)} well-behaved request(s) failed (collateral)")
    for fault in report.faults:
        if fault.alive_after_s is None:
            report.violations.append(f"the replica was not alive again within "
                                     f"{config.recovery_timeout_s:.0f} s: "
                                     f"{fault.describe()}")
    failed_to_inject = any(v.startswith("fault injection") for v in report.violations)
    if config.inject_faults and len(report.faults) < 2 and not failed_to_inject:
        report.violations.append(f"only {len(report.faults)} of 2 faults were injected")


def run_cluster_soak(config: ClusterSoakConfig) -> ClusterSoakReport:
    """Start the server, run the mixed traffic and the faults, check the aftermath; `report.ok` says."""
    report = ClusterSoakReport()
    log = config.log or Path(tempfile.mkstemp(prefix="tokenloop-soak-cluster-", suffix=".log")[1])
    args = ["--model", config.model, "--replicas", "2", "--failover", "recompute",
            "--hang-timeout", str(config.hang_timeout_s), *config.serve_args]
    with served_process(args, log, name="tokenloop serve --replicas 2") as (url, proc):
        begin = time.monotonic()
        asyncio.run(_drive(config, url, proc.pid, report))
        report.elapsed_s = time.monotonic() - begin
        asyncio.run(_probe_each_replica(url, report))
        _check_settled(url, config, report)
    _judge(config, report)
    report.engine["server_log"] = str(log)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenloop.bench.soak_cluster",
                                     description=__doc__.split("\n\n")[0])
    defaults = ClusterSoakConfig()
    parser.add_argument("--model", default=defaults.model)
    for name in ("num_requests", "concurrency", "max_tokens", "seed", "long_prompt_words"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    for name in ("disconnect_fraction", "hostile_fraction", "structured_fraction", "long_fraction",
                 "hang_timeout", "hang_at", "kill_at", "recovery_timeout", "idle_timeout"):
        attr = name + "_s" if name.endswith("timeout") else name
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, attr),
                            dest=attr)
    parser.add_argument("--no-faults", action="store_false", dest="inject_faults",
                        help="mixed traffic only: no hang, no kill")
    parser.add_argument("--log", type=Path, help="the server's log (default: a new file in the temp dir)")
    parser.add_argument("--serve-arg", action="append", default=[], dest="serve_args",
                        help="one more `tokenloop serve` argument (repeat; e.g. "
                             "--serve-arg=--num-kv-blocks=512)")
    config = ClusterSoakConfig(**vars(parser.parse_args(argv)))
    # SIGTERM (`timeout`, a CI runner) unwinds like Ctrl-C, so the server this soak started is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    report = run_cluster_soak(config)
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
