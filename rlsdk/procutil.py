"""Child-process helpers shared by the launchers and the inference server: ports, process groups, output lines.

``rlsdk.launch`` (train ranks, Slurm jobs, Ray node launches) and ``rlsdk.engine`` (the vLLM server) both start
children in sessions of their own and stop them by process group; these helpers live outside both so that
neither imports the other. Only the standard library at import time (psutil is imported where it is needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlsdk.observe.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class ReplicaServer:
    """An inference server a batch launcher runs on nodes of its own, next to the train ranks.

    The inference engine describes it (:func:`rlsdk.engine.inference.factory.replica_server`) and the launcher runs
    it (:class:`rlsdk.launch.slurm.SlurmLauncher`), so neither needs the other's code.

    Attributes:
        replicas: How many copies, one per node.
        command: The server's command line without ``--host``/``--port`` (the launcher appends its node's name and
            a port free there), its environment as a leading ``env K=V ...``.
        start_timeout_s: Seconds a replica may take to become healthy.
        token_env: The environment variable through which every replica reads its bearer token (the launcher makes
            a fresh one and exports it to the job, never into a file).
    """

    replicas: int
    command: tuple[str, ...]
    start_timeout_s: float
    token_env: str


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` now ('' = every interface). Best effort: another process may bind it before the
    caller's child does, so use it only where the child cannot pick its own (port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


async def start_in_own_session(
    cmd: Sequence[str], env: Mapping[str, str], *, cwd: str | None = None
) -> asyncio.subprocess.Process:
    """Start ``cmd`` in a session (and process group) of its own, stdout and stderr merged into one pipe.

    Its own session: a Ctrl-C in the notebook does not reach it, and :func:`signal_group` with its pid stops it
    and every child it did not move to another group.
    """
    return await asyncio.create_subprocess_exec(
        *cmd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        env=dict(env),
        cwd=cwd,
    )


async def pump_lines(
    stream: asyncio.StreamReader, last_lines: deque[str], on_line: Callable[[str], None] | None
) -> None:
    """Read ``stream`` to its end: append each decoded line to ``last_lines`` (bounded) and call ``on_line``."""
    while True:
        raw = await stream.readline()
        if not raw:
            return
        line = raw.decode(errors="replace").rstrip()
        last_lines.append(line)
        if on_line is not None:
            on_line(line)


def _check_child_group(pgid: int) -> None:
    # os.killpg(0, ...) would reach the caller's own group (the notebook's kernel), 1 is init's, and a negative id
    # (the -1 pid of a launch with no process of its own) is no group: never signal those.
    if pgid <= 1:
        raise ValueError(f"pgid={pgid} is not a child's process group: expected the pid (> 1) of a child started in a "
                         "session of its own")  # fmt: skip


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid`` (a child of :func:`start_in_own_session`: its pid); a group that is
    already gone is not an error.

    Raises:
        ValueError: ``pgid`` <= 1 (the caller's own group, init's, or no group).
    """
    _check_child_group(pgid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def stop_group(proc: asyncio.subprocess.Process, grace_s: float, what: str) -> None:
    """SIGTERM the process group of ``proc`` (a child of :func:`start_in_own_session`), SIGKILL it when ``proc``
    has not exited after ``grace_s``; returns once ``proc`` exited. ``what`` names it in the warning."""
    if proc.returncode is not None:
        return
    signal_group(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), timeout=grace_s)
    except TimeoutError:
        logger.warning("%s did not stop within %.0f s; killing it", what, grace_s)
        signal_group(proc.pid, signal.SIGKILL)
        await proc.wait()


async def wait_group_gone(pgid: int, timeout_s: float = 5.0) -> None:
    """Wait until no process of group ``pgid`` is left (SIGKILLed members take a moment to be reaped).

    Raises:
        ValueError: ``pgid`` <= 1, as :func:`signal_group`.
    """
    _check_child_group(pgid)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        await asyncio.sleep(0.05)


# multiprocessing's resource tracker: started by a process that creates named semaphores or shared memory with the
# 'spawn' or 'forkserver' method, it unlinks what its clients leave once the last of them is gone. It ignores SIGTERM
# and SIGINT for that reason; a SIGKILL of its whole process group kills it before it can clean up.
_RESOURCE_TRACKER = "multiprocessing.resource_tracker"


def _group_members(pgid: int) -> list[Any]:
    import psutil

    members = []
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(process.pid) == pgid:
                members.append(process)
    return members


async def kill_group(pgid: int, *, tracker_grace_s: float = 5.0) -> None:
    """SIGKILL every process of group ``pgid`` except multiprocessing's resource trackers, wait until the group is
    gone, and SIGKILL the trackers only if they outlive ``tracker_grace_s``.

    A tracker sees its clients die, unlinks the semaphores (``/dev/shm/sem.mp-*``) and shared memory they left, and
    exits: killing it with the rest leaves those in ``/dev/shm`` (shared by every user, kept until reboot).

    Raises:
        ValueError: ``pgid`` <= 1, as :func:`signal_group`.
    """
    _check_child_group(pgid)
    trackers = []
    for process in _group_members(pgid):
        if any(_RESOURCE_TRACKER in part for part in process.info["cmdline"] or ()):
            trackers.append(process)
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(process.pid, signal.SIGKILL)
    if trackers:
        await wait_group_gone(pgid, timeout_s=tracker_grace_s)
    signal_group(pgid, signal.SIGKILL)  # what is left: a tracker that did not finish, a child started meanwhile


def pid_alive(pid: int | None) -> bool:
    """True while process ``pid`` exists and is not a zombie; False for None or a process we may not inspect."""
    if pid is None:
        return False
    try:
        import psutil

        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except Exception:  # NoSuchProcess, AccessDenied: not ours to watch
        return False


async def reap(pids: Iterable[int], grace_s: float, what: str = "process") -> None:
    """SIGTERM each live pid of ``pids``, SIGKILL those still alive after ``grace_s`` (processes that run in
    sessions of their own, which signalling their parent's group does not reach)."""
    alive = [pid for pid in pids if pid_alive(pid)]
    if not alive:
        return
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while alive and loop.time() < deadline:
        await asyncio.sleep(0.1)
        alive = [pid for pid in alive if pid_alive(pid)]
    for pid in alive:
        logger.warning("%s %d ignored SIGTERM; killing it", what, pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
