"""The cluster soak's injected faults: stop (SIGSTOP) or kill (SIGKILL) one replica's engine core, and time
its recovery as a client sees it.

A fault waits until its replica holds requests, so it always lands on work in flight. The core's pid comes
from `/admin/replicas` and is signalled only if it descends from the server process the soak started.
Recovery is timed from the signal to: the replica declared dead, the replica alive again (restarted, as
`/admin/replicas` shows it), and the first token the restarted replica generates (its
`tokenloop:generation_tokens_total{replica=...}` grows: a request routed to it made progress).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import httpx

POLL_S = 0.1


@dataclass
class FaultRecord:
    """One injected fault and how long the cluster took to get over it (None: never seen)."""

    kind: str  # "hang" (SIGSTOP past the heartbeat bound) or "kill" (SIGKILL)
    replica: int
    pid: int
    requests_on_replica: int  # in flight there when the signal went
    at: float  # monotonic time of the signal
    dead_after_s: float | None = None
    alive_after_s: float | None = None
    first_token_after_s: float | None = None
    death: str | None = None

    @property
    def window(self) -> tuple[float, float]:
        """From the signal to the replica alive again (or forever, if it never came back)."""
        end = self.at + self.alive_after_s if self.alive_after_s is not None else float("inf")
        return self.at, end

    def describe(self) -> str:
        def s(value: float | None) -> str:
            return "never" if value is None else f"{value:.2f} s"
        return (f"{self.kind} of replica {self.replica} (pid {self.pid}, "
                f"{self.requests_on_replica} request(s) "
                f"there): declared dead after {s(self.dead_after_s)} ({self.death}), alive again after "
                f"{s(self.alive_after_s)}, first token on it after {s(self.first_token_after_s)}"
                + (" (the router sent it nothing before the run ended)"
                   if self.first_token_after_s is None and self.alive_after_s is not None else ""))


def replica_metric(text: str, name: str) -> dict[int, float]:
    """A per-replica series of the /metrics text, by replica index."""
    values: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith(name + "{") or 'replica="' not in line:
            continue
        replica = int(line.split('replica="', 1)[1].split('"', 1)[0])
        values[replica] = values.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether `pid` is `ancestor` or one of its descendants (read from /proc)."""
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent's pid
    return False


async def replicas(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    r = await client.get("/admin/replicas", timeout=30)
    r.raise_for_status()
    return list(r.json()["replicas"])


async def _generated(client: httpx.AsyncClient, replica: int) -> float:
    r = await client.get("/metrics", timeout=30)
    return replica_metric(r.text, "tokenloop:generation_tokens_total").get(replica, 0.0)


async def inject(client: httpx.AsyncClient, kind: str, replica: int, server_pid: int,
                 recovery_timeout_s: float, faults: list[FaultRecord]) -> FaultRecord:
    """Signal replica `replica`'s core once it holds requests (the record joins `faults` then); return once
    the replica is alive again, or after `recovery_timeout_s`."""
    while True:  # land on work in flight
        row = (await replicas(client))[replica]
        if row["alive"] and row["requests"] > 0 and row["pid"]:
            break
        await asyncio.sleep(POLL_S / 2)
    pid, restarts = int(row["pid"]), int(row["restarts"])
    if not descends_from(pid, server_pid):
        raise RuntimeError(f"replica {replica}'s pid {pid} is not a descendant of the server ({server_pid})")
    record = FaultRecord(kind, replica, pid, int(row["requests"]), time.monotonic())
    os.kill(pid, signal.SIGSTOP if kind == "hang" else signal.SIGKILL)
    faults.append(record)
    deadline = record.at + recovery_timeout_s
    try:
        while time.monotonic() < deadline:
            row = (await replicas(client))[replica]
            now = time.monotonic() - record.at
            if record.dead_after_s is None and (not row["alive"] or row["restarts"] > restarts):
                record.dead_after_s, record.death = now, row["death"]
            if row["alive"] and row["restarts"] > restarts:
                record.alive_after_s = now
                break
            await asyncio.sleep(POLL_S)
    finally:
        if kind == "hang":  # the server should have killed it; if not, let it go on, never leave it stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    return record


async def watch_first_token(client: httpx.AsyncClient, record: FaultRecord) -> None:
    """Note when the restarted replica generates its first token (run until cancelled or seen): the router
    decides when a request goes there, so this may never come while the other replica has room."""
    baseline = await _generated(client, record.replica)
    while True:
        if await _generated(client, record.replica) > baseline:
            record.first_token_after_s = time.monotonic() - record.at
            return
        await asyncio.sleep(POLL_S)
