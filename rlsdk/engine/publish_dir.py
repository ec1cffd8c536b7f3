"""The directory a Session publishes its weights to (``/dev/shm`` where it exists), and its cleanup after a crash.

``Session.close`` removes the directory, but a controller that is killed (a Jupyter kernel restarted or OOM-killed,
``kill -9``) cannot, and on ``/dev/shm`` the published weights then hold their size in RAM until the machine
reboots: a 7B model leaks ~14 GB per killed kernel. So each directory holds a lock file that its Session keeps
locked (``flock``) while it lives; the kernel drops the lock when the process dies, however it dies. Creating a new
directory first removes every ``rlsdk-weights-*`` directory of this user whose lock can be taken: its owner is gone.
A live Session's lock cannot be taken, whichever PID namespace it runs in (the lock belongs to the open file), so a
sweep never touches it. Directories without a lock file (written by rlsdk before this module) are left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from rlsdk.observe.logging import get_logger

logger = get_logger(__name__)

PREFIX = "rlsdk-weights-"
LOCK_NAME = ".owner.lock"


def default_root() -> str:
    """Where rlsdk puts memory shared between its processes (published weights, the ranks' all-reduce segment):
    ``/dev/shm`` when the machine has it, else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class PublishDir:
    """A fresh ``PREFIX*`` directory under ``root``, locked by this process until :meth:`remove`.

    Args:
        root: where to create it; ``None`` = :func:`default_root`.

    Raises:
        OSError: the directory or its lock file cannot be created.
    """

    def __init__(self, root: str | None = None) -> None:
        root = default_root() if root is None else root
        sweep_stale(root)
        self.path = tempfile.mkdtemp(prefix=PREFIX, dir=root)
        # Locked under another name, then renamed: a concurrent sweep only opens LOCK_NAME, so it never finds the
        # lock file unlocked.
        pending = os.path.join(self.path, LOCK_NAME + ".new")
        self._lock_fd: int | None = os.open(pending, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(pending, os.path.join(self.path, LOCK_NAME))

    def remove(self) -> None:
        """Delete the directory and release the lock; idempotent."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def sweep_stale(root: str) -> list[str]:
    """Remove the ``PREFIX*`` directories under ``root`` owned by this user whose lock file no live process holds;
    returns their paths. Never raises: a directory it cannot inspect or remove is left as it is."""
    removed: list[str] = []
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        lock_path = entry / LOCK_NAME
        try:
            if entry.is_symlink() or not entry.is_dir() or entry.stat().st_uid != os.getuid():
                continue
            fd = os.open(lock_path, os.O_RDWR)
        except OSError:  # no lock file (an older rlsdk's directory, or one being created): not ours to judge
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live Session holds it
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    if removed:
        logger.info("removed %d weight director%s left by a killed session: %s", len(removed),
                    "y" if len(removed) == 1 else "ies", ", ".join(removed))  # fmt: skip
    return removed
