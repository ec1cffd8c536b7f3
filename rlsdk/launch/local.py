"""Start and supervise the train ranks on this machine with ``accelerate launch``.

The launcher runs as a background process in its own session (so a Ctrl-C in the notebook does not reach it)
with ``PR_SET_PDEATHSIG`` set (so it dies with the controller). Each rank also sets it and exits when the
controller's heartbeat stops; nothing outlives the Session.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rlsdk.launch.output import pump_lines
from rlsdk.observe.logging import get_logger

logger = get_logger(__name__)


class RankProcessError(RuntimeError):
    """The rank processes exited while the Session expected them to run.

    ``returncode`` and ``last_lines`` are the launcher's (``accelerate launch``). When its failure summary names
    the rank that failed first (torchelastic's "Root Cause" block), ``failed_rank``, ``rank_returncode`` (negative:
    killed by that signal) and ``rank_pid`` say which, and ``rank_log_lines`` holds that rank's last log lines.
    """

    def __init__(
        self, returncode: int | None, last_lines: Iterable[str], *, rank_log_lines: Iterable[str] = ()
    ) -> None:
        self.returncode = returncode
        self.last_lines = list(last_lines)
        self.rank_log_lines = list(rank_log_lines)
        self.failed_rank, self.rank_returncode, self.rank_pid = root_cause(self.last_lines)
        tail = "\n".join(self.last_lines[-20:]) or "(no output)"
        text = f"train ranks (accelerate launch) exited: {_how(returncode)}."
        if self.failed_rank is not None:
            text = (
                f"train rank {self.failed_rank} (pid {self.rank_pid}) {_how(self.rank_returncode)}; accelerate "
                f"launch stopped the other ranks and exited: {_how(returncode)}."
            )
            if self.rank_log_lines:
                text += f"\nLast log lines of rank {self.failed_rank}:\n" + "\n".join(self.rank_log_lines[-20:])
        super().__init__(f"{text}\nLast output lines:\n{tail}")


def _how(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


_ROOT_CAUSE = re.compile(
    r"Root Cause.*?rank\s*:\s*(?P<rank>\d+).*?exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)", re.S
)


def root_cause(lines: Sequence[str]) -> tuple[int | None, int | None, int | None]:
    """``(rank, exit code, pid)`` of the first failed rank in torchelastic's failure summary; Nones if absent."""
    match = _ROOT_CAUSE.search("\n".join(lines))
    if match is None:
        return None, None, None
    return int(match["rank"]), int(match["code"]), int(match["pid"])


def accelerate_command(num_ranks: int, module: str = "rlsdk.worker", *, file_rendezvous: bool = False) -> list[str]:
    """The ``accelerate launch`` command line for ``num_ranks`` CPU ranks on this machine.

    ``--cpu`` would start one process (multi-process CPU needs MPI there); ``--multi_gpu`` with
    ``Accelerator(cpu=True)`` in the rank gives N gloo ranks. Port 0 lets accelerate pick a free port (a busy
    default port would switch it to a "standalone" TCP rendezvous). accelerate refuses ``--multi_gpu`` with one
    process: one rank runs with ``--cpu`` (its plain launcher sets no torchrun variables;
    :func:`single_rank_environment` gives them). Run through :mod:`rlsdk.launch.accelerate_entry`: accelerate's
    own launch code, with the parent-death signal set, rlsdk's file rendezvous registered and without interpreter
    teardown at exit. ``file_rendezvous``: torchrun's rendezvous in files of ``$RLSDK_RENDEZVOUS_DIR`` (no TCP
    store; :mod:`rlsdk.launch.rendezvous`).
    """
    rendezvous = ["--rdzv_backend", "rlsdk-file"] if file_rendezvous else []
    if num_ranks == 1:
        return [
            sys.executable, "-m", "rlsdk.launch.accelerate_entry",
            "--cpu",
            "--num_processes", "1",
            "--num_machines", "1",
            "--mixed_precision", "no",
            "--dynamo_backend", "no",
            "-m", module,
        ]  # fmt: skip
    return [
        sys.executable, "-m", "rlsdk.launch.accelerate_entry",
        "--multi_gpu",
        "--num_processes", str(num_ranks),
        "--num_machines", "1",
        "--mixed_precision", "no",
        "--dynamo_backend", "no",
        "--main_process_port", "0",
        *rendezvous,
        "-m", module,
    ]  # fmt: skip


class LocalLauncher:
    """One ``accelerate launch`` process group running ``num_ranks`` ranks of ``rlsdk.worker``."""

    def __init__(self, proc: asyncio.subprocess.Process, on_line: Callable[[str], None] | None) -> None:
        self.proc = proc
        self.last_lines: deque[str] = deque(maxlen=200)
        self._on_line = on_line
        self._reader = asyncio.get_running_loop().create_task(self._read_output())
        self.rank_pids: list[int] = []

    @classmethod
    async def start(
        cls,
        num_ranks: int,
        env: Mapping[str, str],
        *,
        on_line: Callable[[str], None] | None = None,
        module: str = "rlsdk.worker",
    ) -> LocalLauncher:
        """Start the ranks in the background; returns at once (ranks then connect to the control channel).

        With ``RLSDK_RENDEZVOUS_DIR`` in ``env`` the ranks meet through files there, not a TCP store
        (:mod:`rlsdk.launch.rendezvous`)."""
        from rlsdk.launch.rendezvous import RLSDK_RENDEZVOUS_DIR

        cmd = accelerate_command(num_ranks, module, file_rendezvous=bool(env.get(RLSDK_RENDEZVOUS_DIR)))
        logger.debug("launching: %s", " ".join(cmd))
        env = {**env, **single_rank_environment()} if num_ranks == 1 else dict(env)
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        logger.info("started %d train ranks (launcher pid %d)", num_ranks, proc.pid)
        return cls(proc, on_line)

    async def _read_output(self) -> None:
        assert self.proc.stdout is not None
        await pump_lines(self.proc.stdout, self.last_lines, self._on_line)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        """Wait for the launcher to exit (output drained); returns its exit code."""
        code = await self.proc.wait()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._reader), timeout=2.0)
        return code

    def error(self, rank_log_lines: Callable[[int], Iterable[str]] | None = None) -> RankProcessError:
        """The launcher's exit as an error; ``rank_log_lines(rank)`` adds the failed rank's last log lines."""
        failed, _, _ = root_cause(list(self.last_lines))
        lines = rank_log_lines(failed) if rank_log_lines is not None and failed is not None else ()
        return RankProcessError(self.proc.returncode, self.last_lines, rank_log_lines=lines)

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the launcher's process group (torchrun then stops its ranks), SIGKILL after ``grace_s``.

        Ranks run in their own sessions (torchrun starts them so), so any rank pid still alive afterwards is
        killed directly. Idempotent.
        """
        if self.proc.returncode is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout=grace_s)
            except TimeoutError:
                logger.warning("launcher did not stop within %.0f s; killing it", grace_s)
                _signal_group(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        await _reap_ranks(self.rank_pids, grace_s=min(grace_s, 5.0))
        if not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        return self.proc.returncode


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(os.getpgid(pid), sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _alive(pid: int) -> bool:
    try:
        import psutil

        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False


async def _reap_ranks(pids: list[int], grace_s: float) -> None:
    alive = [pid for pid in pids if _alive(pid)]
    if not alive:
        return
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while alive and loop.time() < deadline:
        await asyncio.sleep(0.1)
        alive = [pid for pid in alive if _alive(pid)]
    for pid in alive:
        logger.warning("rank process %d ignored SIGTERM; killing it", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def single_rank_environment() -> dict[str, str]:
    """The torchrun variables of a one-rank group (``accelerate launch --cpu`` sets none): rank 0 of 1, its
    store on a free loopback port."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def rank_environment(base: Mapping[str, str], extra: Mapping[str, Any]) -> dict[str, str]:
    """The environment for the ranks: the controller's, plus rlsdk's variables, minus inherited rank state."""
    env = {k: v for k, v in base.items() if k not in _INHERITED_RANK_VARS}
    env.update({k: str(v) for k, v in extra.items()})
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# A controller started inside another distributed job must not leak its rank identity into ours.
_INHERITED_RANK_VARS = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"}
)
