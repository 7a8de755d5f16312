"""A `tokenloop serve` in a child process for a benchmark: started on a free local port, healthy, stopped.

The child leads a session of its own, so a Ctrl-C on the terminal reaches only the benchmark, which stops
the server in order (SIGINT: a graceful shutdown that stops its engine cores too), then kills the whole
group so no engine core or Ray worker is left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from tokenloop.serving.server import free_port

HEALTH_TIMEOUT_S = 600.0  # loading the default model (and its kernels) on a fresh machine takes a while
STOP_TIMEOUT_S = 30.0


def tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    return ""


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT, then SIGKILL to the whole process group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"server pid {proc.pid} ignored SIGINT for {STOP_TIMEOUT_S:.0f} s: killing it", file=sys.stderr)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_TIMEOUT_S)


@contextlib.contextmanager
def served(serve_args: Sequence[str], log: Path, *, name: str = "server",
           health_timeout_s: float = HEALTH_TIMEOUT_S) -> Iterator[str]:
    """`tokenloop serve SERVE_ARGS` on 127.0.0.1 and a free port; yields its base URL once healthy."""
    with served_process(serve_args, log, name=name, health_timeout_s=health_timeout_s) as (base_url, _):
        yield base_url


@contextlib.contextmanager
def served_process(serve_args: Sequence[str], log: Path, *, name: str = "server",
                   health_timeout_s: float = HEALTH_TIMEOUT_S) -> Iterator[tuple[str, subprocess.Popen]]:
    """As `served`, also yielding the server's process (for its memory, or to find its engine cores)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokenloop", "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + health_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} before it was healthy:\n{tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not healthy after {health_timeout_s:.0f} s:\n{tail(log)}")
            time.sleep(0.5)
        yield base_url, proc
        if proc.poll() is not None:
            raise RuntimeError(f"{name} died during the run ({proc.returncode}):\n{tail(log)}")
    finally:
        stop_server(proc)
