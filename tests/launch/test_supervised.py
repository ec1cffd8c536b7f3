"""The part every launcher shares (rlsdk.launch.supervised), driven through LocalLauncher around real processes:
output lines, exit, the error naming the failed rank, a stop that escalates to SIGKILL and reaps rank pids."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

from rlsdk.launch.local import LocalLauncher
from rlsdk.launch.supervised import RankProcessError, SupervisedLauncher
from rlsdk.procutil import pid_alive, start_in_own_session

# What torchelastic prints when a rank died: the launcher's error names that rank from it.
ROOT_CAUSE = textwrap.dedent(
    """\
    Root Cause (first observed failure):
    [0]:
      time      : 2026-12-01_10:00:00
      host      : node0
      rank      : 1 (local_rank: 1)
      exitcode  : -9 (pid: 4242)
    """
)


async def _launcher(script: str, lines: list[str] | None = None) -> LocalLauncher:
    proc = await start_in_own_session(["bash", "-c", script], {"PATH": "/usr/bin:/bin"})
    return LocalLauncher(proc, lines.append if lines is not None else None)


async def _line(launcher: SupervisedLauncher, text: str, timeout_s: float = 10.0) -> str:
    async def seen() -> str:
        while not any(text in line for line in launcher.last_lines):
            await asyncio.sleep(0.02)
        return next(line for line in launcher.last_lines if text in line)

    return await asyncio.wait_for(seen(), timeout_s)


def test_launcher_when_its_process_exits_returns_the_exit_code_with_every_line_kept_and_handed_on() -> None:
    async def main() -> tuple[int, list[str], list[str], RankProcessError]:
        seen: list[str] = []
        launcher = await _launcher("echo one; echo two >&2; exit 3", seen)
        code = await launcher.wait()
        return code, list(launcher.last_lines), seen, launcher.error()

    code, kept, seen, error = asyncio.run(main())

    assert code == 3
    assert kept == seen == ["one", "two"]
    assert error.returncode == 3 and error.failed_rank is None
    assert "exit code 3" in str(error) and "two" in str(error)


def test_launcher_error_when_torchelastic_names_the_failed_rank_adds_that_ranks_log_lines() -> None:
    async def main() -> RankProcessError:
        launcher = await _launcher(f"printf %s {_quote(ROOT_CAUSE)}; exit 1")
        await launcher.wait()
        return launcher.error(rank_log_lines=lambda rank: [f"ERROR rank {rank} ran out of memory"])

    error = asyncio.run(main())

    assert (error.failed_rank, error.rank_returncode, error.rank_pid) == (1, -9, 4242)
    assert error.rank_log_lines == ["ERROR rank 1 ran out of memory"]
    assert "train rank 1 (pid 4242) killed by signal SIGKILL" in str(error)


def test_launcher_stop_when_its_group_ignores_sigterm_kills_the_whole_group_after_the_grace() -> None:
    async def main() -> tuple[int | None, int]:
        launcher = await _launcher("trap '' TERM; sleep 60 & echo child $!; wait")
        child = int((await _line(launcher, "child")).split()[1])
        code = await launcher.stop(grace_s=0.5)
        return code, child

    code, child = asyncio.run(main())

    assert code == -9
    assert not pid_alive(child)


def test_launcher_stop_when_ranks_run_in_their_own_sessions_stops_them_too() -> None:
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:

        async def main() -> int | None:
            launcher = await _launcher("echo ready; sleep 60")
            await _line(launcher, "ready")
            launcher.rank_pids = [rank.pid]
            return await launcher.stop(grace_s=2.0)

        code = asyncio.run(main())
        rank_code = rank.wait(timeout=10.0)
    finally:
        rank.kill()

    assert code == -15
    assert rank_code == -15


def test_rank_pids_of_a_cluster_launcher_read_back_empty_so_no_other_machines_pid_is_signalled() -> None:
    async def main() -> tuple[list[int], list[int]]:
        proc = await start_in_own_session(["true"], {"PATH": "/usr/bin:/bin"})
        cluster = SupervisedLauncher(proc, None, local_ranks=False)
        local = SupervisedLauncher(proc, None, local_ranks=True)
        cluster.rank_pids = local.rank_pids = [4242, 4243]
        await proc.wait()
        return cluster.rank_pids, local.rank_pids

    cluster, local = asyncio.run(main())

    assert cluster == []
    assert local == [4242, 4243]


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"
