"""A local Ray that a server started lives in a directory of that server's: removed when it stops, and
reaped by the next one when the server was killed (Ray's processes die with it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed: pip install 'tokenloop[ray]'")

from tests.serving.test_core_process import _alive
from tokenloop.core.private_dir import LOCK_NAME, PrivateDir

REPO = Path(__file__).resolve().parents[2]

# Starts a local Ray, stops it, starts another and waits to be killed.
_SERVER = """
import sys
from tokenloop.cluster.ray_replica import start_ray
cluster = start_ray(None, num_cpus=1, log_to_driver=False)
print(cluster.directory.path, flush=True)
cluster.stop()
cluster = start_ray(None, num_cpus=1, log_to_driver=False)
print(cluster.directory.path, flush=True)
sys.stdin.read()  # until killed
"""


def _pids_using(path: str) -> list[int]:
    """Processes whose command line names `path` (Ray's own take their session dir as an argument)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and path.encode() in Path(f"/proc/{entry}/cmdline").read_bytes() and _alive(int(entry)):
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def test_a_killed_servers_ray_session_is_reaped_by_the_next(tmp_path: Path) -> None:
    server = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert server.stdout is not None
        stopped = Path(server.stdout.readline().strip())
        running = Path(server.stdout.readline().strip())
        assert stopped.name.startswith("tokenloop-ray-") and not stopped.exists()  # a clean stop removes it
        assert (running / LOCK_NAME).exists() and any(running.glob("session_*"))
        ray_processes = _pids_using(str(running))
        assert ray_processes, "no Ray process runs in the session directory"
        server.send_signal(signal.SIGKILL)
        server.wait()
        deadline = time.monotonic() + 30
        while left := [pid for pid in ray_processes if _alive(pid)]:
            assert time.monotonic() < deadline, f"Ray's processes {left} outlived the server"
            time.sleep(0.1)
        assert running.exists()  # SIGKILL: nothing cleaned up
        PrivateDir.create(base=str(tmp_path)).remove()  # not there: another temp dir reaps nothing of it
        assert running.exists()
        PrivateDir.create().remove()  # the next server's directory, where the dead one's lies
        assert not running.exists()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
