"""Time from starting a server to serving (issue 11's "ready to serve <= 3 s after start").

Each run starts a fresh `python -m tokenloop serve` (default model, dtype auto, on 127.0.0.1), polls
/health every 10 ms and then sends one streaming chat completion of one token; it reports, from the
spawn: /health answering 200 and the first token received. With `--llama-cpp` it times llama.cpp's
`llama-server` on the same GGUF the same way, alternating with tokenloop (built by
scripts/baselines/llama_cpp.sh). The kernels are built at install, so a run never compiles.

Usage: python scripts/bench_ready.py [--runs 5] [--llama-cpp] [-- EXTRA SERVE ARGS]
To time another checkout, run from outside any checkout with PYTHONPATH=<that tree>: `python -m` puts the
working directory first on the path, so inside a checkout the server imports that one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenloop.bench.server_process import stop_server
from tokenloop.model.loader import DEFAULT_MODEL, resolve_model_path
from tokenloop.serving.server import free_port

POLL_S = 0.01
TIMEOUT_S = 120.0


def time_to_ready(cmd: list[str], port: int) -> tuple[float, float]:
    """Seconds from spawning `cmd` to /health 200, and to the first streamed token of a chat completion."""
    base = f"http://127.0.0.1:{port}"
    # One client for every poll: `httpx.get` builds a client (and an SSL context) per call, ~10 ms of CPU
    # that a 10 ms poll would take from the server starting on the same 2 cores.
    client = httpx.Client(timeout=1.0)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        healthy = None
        while healthy is None:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode} before it was healthy")
            try:
                if client.get(f"{base}/health").status_code == 200:
                    healthy = time.perf_counter() - started
            except httpx.HTTPError:
                pass
            if time.perf_counter() - started > TIMEOUT_S:
                raise RuntimeError(f"not healthy after {TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)
        # No "model": each server answers for the one it serves (tokenloop refuses a name it does not serve).
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": True}
        with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=TIMEOUT_S) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    return healthy, time.perf_counter() - started
        raise RuntimeError("the stream ended without a token")
    finally:
        client.close()
        stop_server(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--llama-cpp", action="store_true", help="also time llama-server, alternating")
    parser.add_argument("serve_args", nargs="*", help="extra `tokenloop serve` arguments (after --)")
    args = parser.parse_args()

    servers = {"tokenloop": lambda port: [sys.executable, "-m", "tokenloop", "serve", "--host", "127.0.0.1",
                                          "--port", str(port), *args.serve_args]}
    if args.llama_cpp:
        # The binary itself, not llama_cpp.sh (which starts a Python to find the model before it execs).
        cache = Path(os.environ.get("TOKENLOOP_LLAMA_CPP_DIR", Path.home() / ".cache" / "tokenloop" / "llama.cpp"))
        binary, model = str(cache / "build" / "bin" / "llama-server"), str(resolve_model_path(DEFAULT_MODEL))
        servers["llama.cpp"] = lambda port: [binary, "-m", model, "-t", str(os.cpu_count()), "--host", "127.0.0.1",
                                             "--port", str(port), "-np", "1", "-c", "4096"]
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
    for run in range(args.runs):
        for name, command in servers.items():
            port = free_port()
            times[name].append(time_to_ready(command(port), port))
            print(f"run {run + 1} {name}: healthy {times[name][-1][0]:.2f} s, first token {times[name][-1][1]:.2f} s",
                  flush=True)
    print("| server | /health 200, s (min / median / max) | first token, s (min / median / max) |")
    print("| --- | --- | --- |")
    for name, runs in times.items():
        cells = []
        for column in zip(*runs):
            cells.append(f"{min(column):.2f} / {statistics.median(column):.2f} / {max(column):.2f}")
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
