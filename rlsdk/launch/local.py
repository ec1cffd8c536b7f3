"""Start and supervise the train ranks on this machine with ``accelerate launch``.

The launcher runs as a background process in its own session (so a Ctrl-C in the notebook does not reach it)
with ``PR_SET_PDEATHSIG`` set (so it dies with the controller). Each rank also sets it and exits when the
controller's heartbeat stops; nothing outlives the Session.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Mapping
from typing import Any

from rlsdk.config.device import Device, accelerate_launch_args, rank_device
from rlsdk.launch.supervised import RankProcessError, SupervisedLauncher, root_cause
from rlsdk.observe.logging import get_logger
from rlsdk.procutil import free_port, pump_lines, start_in_own_session

# Re-exported: RankProcessError (public as rlsdk.RankProcessError) and root_cause were first defined here.
__all__ = [
    "LocalLauncher",
    "RankProcessError",
    "accelerate_command",
    "rank_environment",
    "root_cause",
    "single_rank_environment",
]

logger = get_logger(__name__)


def accelerate_command(
    num_ranks: int, module: str = "rlsdk.worker", *, file_rendezvous: bool = False, device: Device = "cpu"
) -> list[str]:
    """The ``accelerate launch`` command line for ``num_ranks`` ranks on this machine, on ``device``.

    The device flags come from :func:`rlsdk.config.device.accelerate_launch_args`: on CPU, ``--cpu`` would start
    one process (multi-process CPU needs MPI there), so ``--multi_gpu`` with the rank's CPU ``Accelerator`` gives N
    gloo ranks. Port 0 lets accelerate pick a free port (a busy default port would switch it to a "standalone" TCP
    rendezvous). accelerate refuses ``--multi_gpu`` with one process: one rank runs under accelerate's plain
    launcher (which sets no torchrun variables; :func:`single_rank_environment` gives them). Run through
    :mod:`rlsdk.launch.accelerate_entry`: accelerate's own launch code, with the parent-death signal set, rlsdk's
    file rendezvous registered and without interpreter teardown at exit. ``file_rendezvous``: torchrun's rendezvous
    in files of ``$RLSDK_RENDEZVOUS_DIR`` (no TCP store; :mod:`rlsdk.launch.rendezvous`).
    """
    rendezvous = ["--rdzv_backend", "rlsdk-file"] if file_rendezvous else []
    device_args = accelerate_launch_args(device, num_ranks)
    if num_ranks == 1:
        return [
            sys.executable, "-m", "rlsdk.launch.accelerate_entry",
            *device_args,
            "--num_processes", "1",
            "--num_machines", "1",
            "--dynamo_backend", "no",
            "-m", module,
        ]  # fmt: skip
    return [
        sys.executable, "-m", "rlsdk.launch.accelerate_entry",
        *device_args,
        "--num_processes", str(num_ranks),
        "--num_machines", "1",
        "--dynamo_backend", "no",
        "--main_process_port", "0",
        *rendezvous,
        "-m", module,
    ]  # fmt: skip


class LocalLauncher(SupervisedLauncher):
    """One ``accelerate launch`` process group running ``num_ranks`` ranks of ``rlsdk.worker``."""

    def __init__(self, proc: asyncio.subprocess.Process, on_line: Callable[[str], None] | None) -> None:
        super().__init__(proc, on_line)
        assert proc.stdout is not None
        self._read_output(pump_lines(proc.stdout, self.last_lines, on_line))

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

        cmd = accelerate_command(
            num_ranks, module, file_rendezvous=bool(env.get(RLSDK_RENDEZVOUS_DIR)), device=rank_device(env)
        )
        logger.debug("launching: %s", " ".join(cmd))
        env = {**env, **single_rank_environment()} if num_ranks == 1 else dict(env)
        proc = await start_in_own_session(cmd, env)
        logger.info("started %d train ranks (launcher pid %d)", num_ranks, proc.pid)
        return cls(proc, on_line)

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the launcher's process group (torchrun then stops its ranks), SIGKILL after ``grace_s``.

        Ranks run in their own sessions (torchrun starts them so), so any rank pid still alive afterwards is
        killed directly. Idempotent.
        """
        await self._stop_process(grace_s, "launcher", reader_grace_s=0.0)
        return self.proc.returncode


def single_rank_environment() -> dict[str, str]:
    """The torchrun variables of a one-rank group (``accelerate launch --cpu`` sets none): rank 0 of 1, its
    store on a free loopback port."""
    port = free_port("127.0.0.1")
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
