"""What every launcher shares: the supervising process, the last lines of its output, the ranks' pids, its exit.

Each scheduler has one process (or process-like job) whose exit means the ranks are gone: ``accelerate launch``
on this machine, ``sbatch --wait`` for a Slurm job, the node launches' futures on Ray. :class:`SupervisedLauncher`
holds it and gives the Session the part of :class:`rlsdk.launch.select.Launcher` that does not depend on the
scheduler (``last_lines``, ``rank_pids``, ``returncode``, ``wait``, ``error``); a launcher adds how it starts,
how it reads its output and how it stops. A base class rather than a helper each launcher holds: the Session
reads these members on the launcher itself, and forwarding them from a held helper would repeat the same five
members in every launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, Protocol

from rlsdk.procutil import reap, stop_group

# Lines of the supervising process's output kept for error messages.
LAST_LINES = 200


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


class SupervisedProcess(Protocol):
    """The process (or process-like job) a launcher supervises: its exit means the ranks are gone."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...


class SupervisedLauncher:
    """The scheduler-independent part of a launcher (see the module docstring).

    ``local_ranks``: the ranks run on this machine, so their pids (``rank_pids``, set by the Session once the
    ranks said hello) may be signalled; False on a cluster, where they are other machines' pids and
    ``rank_pids`` reads back empty.
    """

    def __init__(
        self, proc: SupervisedProcess, on_line: Callable[[str], None] | None, *, local_ranks: bool = True
    ) -> None:
        self.proc: Any = proc  # asyncio's Process for the local and Slurm launchers
        self.last_lines: deque[str] = deque(maxlen=LAST_LINES)
        self._on_line = on_line
        self._local_ranks = local_ranks
        self._rank_pids: list[int] = []
        self._reader: asyncio.Task[None] | None = None

    def _read_output(self, reader: Coroutine[Any, Any, None]) -> None:
        """Run ``reader`` (which hands each line to :meth:`emit`) in the background until the output ends."""
        self._reader = asyncio.get_running_loop().create_task(reader)

    def emit(self, line: str) -> None:
        """Keep ``line`` among the last lines and hand it on (the Session logs it with role ``launcher``)."""
        self.last_lines.append(line)
        if self._on_line is not None:
            self._on_line(line)

    @property
    def rank_pids(self) -> list[int]:
        """The ranks' pids when every node is this machine; [] on a cluster (other machines' pids: never signal)."""
        return list(self._rank_pids) if self._local_ranks else []

    @rank_pids.setter
    def rank_pids(self, pids: list[int]) -> None:
        self._rank_pids = list(pids)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        """Wait for the supervised process to exit, its output drained (at most 2 s more); returns its exit code."""
        code = await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._reader), timeout=2.0)
        return int(code)

    def error(self, rank_log_lines: Callable[[int], Iterable[str]] | None = None) -> RankProcessError:
        """The exit as an error; ``rank_log_lines(rank)`` adds the last log lines of the rank that failed first."""
        error = RankProcessError(self.proc.returncode, self.last_lines)
        if rank_log_lines is None or error.failed_rank is None:
            return error
        return RankProcessError(self.proc.returncode, self.last_lines, rank_log_lines=rank_log_lines(error.failed_rank))

    async def _stop_process(self, grace_s: float, what: str, *, reader_grace_s: float) -> None:
        """Stop the supervised process's group (SIGTERM, SIGKILL after ``grace_s``), then the ranks still alive
        on this machine (torchrun starts them in sessions of their own), then the output reader: given up to
        ``reader_grace_s`` to read what is left, cancelled at once with 0."""
        await stop_group(self.proc, grace_s, what)
        await reap(self.rank_pids, grace_s=min(grace_s, 5.0), what="rank process")
        if self._reader is None or self._reader.done():
            return
        if reader_grace_s <= 0:
            self._reader.cancel()
            reader: Any = self._reader
        else:
            reader = asyncio.wait_for(self._reader, timeout=reader_grace_s)
        with contextlib.suppress(asyncio.CancelledError, TimeoutError, Exception):
            await reader
