"""Private temp directories: a dead owner's is reaped by the next one made, a live owner's never is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tokenloop.core.private_dir import LOCK_NAME, PrivateDir, reap_dead

REPO = Path(__file__).resolve().parents[2]

# Makes a directory, says where, then waits to be killed (SIGKILL: no cleanup of any kind runs).
_OWNER = textwrap.dedent("""
    import sys, time
    from tokenloop.core.private_dir import PrivateDir
    directory = PrivateDir.create("test-owner-", sys.argv[1])
    print(directory.path, flush=True)
    time.sleep(600)
""")


def _owner(base: Path) -> tuple[subprocess.Popen[str], Path]:
    process = subprocess.Popen([sys.executable, "-c", _OWNER, str(base)], cwd=REPO, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert process.stdout is not None
    return process, Path(process.stdout.readline().strip())


def test_a_killed_owners_directory_is_reaped_and_a_live_ones_is_not(tmp_path: Path) -> None:
    dead, dead_dir = _owner(tmp_path)
    live, live_dir = _owner(tmp_path)
    try:
        (dead_dir / "input").write_text("a socket's path")
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        assert dead_dir.exists()  # SIGKILL: nothing cleaned up
        unlocked = tmp_path / "test-owner-older"  # no lock file: not ours to judge
        unlocked.mkdir()
        mine = PrivateDir.create("test-owner-", str(tmp_path))  # the next one made reaps the dead
        assert not dead_dir.exists()
        assert live_dir.exists() and (live_dir / LOCK_NAME).exists()
        assert unlocked.exists()
        assert reap_dead("test-owner-", str(tmp_path)) == []  # ours is locked while we hold it
        assert Path(mine.path).exists()
        mine.remove()
        mine.remove()  # idempotent
        assert not Path(mine.path).exists()
    finally:
        live.kill()
        live.wait()
    assert reap_dead("test-owner-", str(tmp_path)) == [str(live_dir)]
