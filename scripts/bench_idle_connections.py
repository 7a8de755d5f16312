"""Issue 34: a bystander's latency beside 10,000 idle connections, and memory after 10,000 distinct users.

Two measurements against `tokenloop serve` (the default model unless --model; engine core in its own
process) on 127.0.0.1:

- latency: a bystander's greedy chat request (`--max-tokens` tokens) and a /health probe, sent one after
  another `--samples` times on an idle server, then again while a hostile client holds `--idle` connections
  open that never send a request head, reopening each one the server closes (after its header-read
  timeout, or when the connection budget evicts it). p50 / p99 of each, and the server's RSS (front end and
  engine core) in both states;
- memory: for each policy a fresh server serves `--users` completions (1 token each, `--concurrency` at a
  time), every one with its own `user` string of `--user-chars` characters; the RSS of the front end and
  the engine core before and after.

Usage: python scripts/bench_idle_connections.py [--model M] [--idle 10000] [--samples 50] [--users 10000]
           [--policies fcfs priority sjf fair] [--skip-latency] [--skip-memory] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import selectors
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

from tokenloop.bench.server_process import served_process


@contextlib.contextmanager
def server(args: argparse.Namespace, log: Path, *extra: str) -> Iterator[tuple[str, psutil.Process]]:
    """`tokenloop serve` on a free port; (base URL, its process) once healthy."""
    serve_args = ["--log-level", "warning", *(["--model", args.model] if args.model else []), *extra]
    with served_process(serve_args, log) as (url, proc):
        yield url, psutil.Process(proc.pid)


def rss_mib(process: psutil.Process) -> dict[str, float]:
    """Resident memory of the front end and of its children (the engine core), MiB."""
    children = process.children(recursive=True)
    return {"front_end": process.memory_info().rss / 2**20,
            "engine_core": sum(c.memory_info().rss for c in children) / 2**20}


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
            "max_ms": 1000 * ordered[-1]}


def bystander(url: str, samples: int, max_tokens: int) -> dict[str, Any]:
    """Latency of a greedy chat request and of /health, each on a fresh connection, `samples` times."""
    chat, health, failures = [], [], 0
    body = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": max_tokens,
            "temperature": 0.0}
    for _ in range(samples):
        with httpx.Client(base_url=url, timeout=60.0) as client:
            begin = time.perf_counter()
            ok = client.get("/health").status_code == 200
            health.append(time.perf_counter() - begin)
        with httpx.Client(base_url=url, timeout=60.0) as client:
            begin = time.perf_counter()
            ok = client.post("/v1/chat/completions", json=body).status_code == 200 and ok
            chat.append(time.perf_counter() - begin)
        failures += not ok
    return {"chat": percentiles(chat), "health": percentiles(health), "failures": failures}


class IdleHolder:
    """A hostile client: `count` connections that never send a request head, each reopened when closed."""

    def __init__(self, url: str, count: int) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.address = (host, int(port))
        self.count = count
        self.reopened = 0
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> None:
        sock = socket.create_connection(self.address, timeout=30.0)
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ)

    def start(self) -> IdleHolder:
        for _ in range(self.count):
            self._open()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.2):
                sock = key.fileobj
                with contextlib.suppress(OSError):
                    if sock.recv(4096):  # type: ignore[union-attr]
                        continue
                self._selector.unregister(sock)
                sock.close()  # type: ignore[union-attr]
                if not self._stop.is_set():
                    with contextlib.suppress(OSError):
                        self._open()
                        self.reopened += 1

    @property
    def open_now(self) -> int:
        return len(self._selector.get_map())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10.0)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]


def measure_latency(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    with server(args, workdir / "latency.log") as (url, process):
        bystander(url, 3, args.max_tokens)  # warm-up
        idle = {"bystander": bystander(url, args.samples, args.max_tokens), "rss_mib": rss_mib(process)}
        holder = IdleHolder(url, args.idle).start()
        try:
            time.sleep(2.0)
            held = {"bystander": bystander(url, args.samples, args.max_tokens), "rss_mib": rss_mib(process),
                    "server_connections": len(process.net_connections(kind="tcp")) - 1,
                    "client_open": holder.open_now, "reopened_during_run": holder.reopened}
        finally:
            holder.stop()
    return {"idle_server": idle, f"{args.idle}_idle_connections": held}


async def distinct_users(url: str, users: int, concurrency: int, user_chars: int) -> int:
    failures = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(users):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal failures
        while not queue.empty():
            i = queue.get_nowait()
            user = f"user-{i:06d}-".ljust(user_chars, "x")
            r = await client.post("/v1/completions", json={"prompt": f"Hello {i}", "max_tokens": 1, "user": user})
            failures += r.status_code != 200

    async with httpx.AsyncClient(base_url=url, timeout=120.0,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return failures


def measure_memory(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for policy in args.policies:
        with server(args, workdir / f"memory-{policy}.log", "--policy", policy) as (url, process):
            asyncio.run(distinct_users(url, 64, 16, args.user_chars))  # warm-up: every code path once
            before = rss_mib(process)
            begin = time.perf_counter()
            failures = asyncio.run(distinct_users(url, args.users, args.concurrency, args.user_chars))
            out[policy] = {"before_mib": before, "after_mib": rss_mib(process), "failures": failures,
                           "seconds": time.perf_counter() - begin}
        print(policy, json.dumps(out[policy]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="default: tokenloop serve's default model")
    parser.add_argument("--idle", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--user-chars", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--policies", nargs="+", default=["fcfs", "priority", "sjf", "fair"])
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this client holds --idle sockets itself
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_latency:
            results["latency"] = measure_latency(args, Path(tmp))
            print(json.dumps(results["latency"], indent=1), flush=True)
        if not args.skip_memory:
            results["memory"] = measure_memory(args, Path(tmp))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
