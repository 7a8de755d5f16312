"""Private temp directories (an engine core's sockets, a local Ray's session) that a killed server leaves
behind, and the next one reaps.

Each directory holds a lock file that its owner keeps locked (`fcntl.flock`) for as long as it uses it. The
kernel drops a flock when the last descriptor of its holder closes, so a server killed with SIGKILL (and a
core it forked, which shares the descriptor) leaves the lock free: whoever takes it may remove the directory.
A live owner's lock cannot be taken, so a live server's directory is never touched. A directory without a
lock file (an older tokenloop's, or another user's) is left alone. Standard library only: `core_launch`
makes one before anything heavy is imported.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

CORE_PREFIX = "tokenloop-core-"  # an engine core's sockets (one per core process, replica or Ray actor)
RAY_PREFIX = "tokenloop-ray-"  # the session of a local Ray instance a server started
OUR_PREFIXES = (CORE_PREFIX, RAY_PREFIX)  # what any of them reaps when it makes its own
LOCK_NAME = "owner.lock"
_NEW_LOCK_NAME = ".owner.lock.new"  # locked before it is renamed to LOCK_NAME: a reaper never sees it free


class PrivateDir:
    """A directory (mode 0700) that this process owns and keeps locked until `remove`."""

    def __init__(self, path: str, lock_fd: int) -> None:
        self.path = path
        self._lock_fd: int | None = lock_fd

    @classmethod
    def create(cls, prefix: str = CORE_PREFIX, base: str | None = None) -> PrivateDir:
        """Reap the dead owners' directories named `prefix*` (and of tokenloop's other kinds) in `base` (the
        temp dir), then make ours."""
        for kind in {prefix, *OUR_PREFIXES}:
            reap_dead(kind, base)
        path = tempfile.mkdtemp(prefix=prefix, dir=base)
        fd = os.open(os.path.join(path, _NEW_LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{os.getpid()}\n".encode())  # for a person looking; the lock is what counts
            os.rename(os.path.join(path, _NEW_LOCK_NAME), os.path.join(path, LOCK_NAME))
        except BaseException:
            os.close(fd)
            shutil.rmtree(path, ignore_errors=True)
            raise
        return cls(path, fd)

    def remove(self) -> None:
        """Remove the directory, then let go of its lock (idempotent)."""
        if self._lock_fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock_fd)
        self._lock_fd = None


def reap_dead(prefix: str = CORE_PREFIX, base: str | None = None) -> list[str]:
    """Remove every `prefix*` directory in `base` whose lock file no live process holds; the paths removed."""
    base = base if base is not None else tempfile.gettempdir()
    try:
        names = [name for name in os.listdir(base) if name.startswith(prefix)]
    except OSError:
        return []
    reaped = []
    for name in names:
        path = os.path.join(base, name)
        try:
            fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY)
        except OSError:
            continue  # no lock file (not ours to judge), another user's, or reaped by someone else just now
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its owner lives
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
        reaped.append(path)
    if reaped:
        logger.info("removed %d directory(ies) left by dead servers: %s", len(reaped), ", ".join(reaped))
    return reaped
