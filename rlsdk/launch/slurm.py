"""Start the train ranks as a Slurm job: one ``accelerate launch`` per node, submitted with ``sbatch``.

The controller (a notebook or a recipe on a login node) writes an sbatch script, submits it with
``sbatch --wait --parsable`` and supervises that process: it exits when the job ends, with the job's exit code.
Inside the allocation ``srun`` starts one task per node; each runs ``accelerate launch --num_machines N
--machine_rank $SLURM_NODEID --main_process_ip <first host of $SLURM_JOB_NODELIST> --main_process_port PORT``,
and torchrun on each node starts that node's ranks. Nothing about the cluster is hard-coded: node names come
from the allocation (``scontrol show hostnames``), the port is chosen when the job is submitted (or set in
``launch.main_process_port``), partition, account and time come from the config.

The job inherits the controller's environment (``--export=ALL``): that is how the ranks learn the control
channel's address and the session secret, which therefore never appear in the script. The ranks connect back to
``launch.host``, which must be reachable from the compute nodes (see ``LaunchConfig.simulate_nodes_on_loopback``
for the one-machine simulation the tests run with a fake Slurm, :mod:`rlsdk.testing.fake_slurm`).

What is not run here: a real Slurm cluster. The generated scripts are snapshot-tested; the simulation runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import shutil
import signal
import socket
import sys
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlsdk.launch.local import RankProcessError, _reap_ranks, _signal_group
from rlsdk.launch.topology import Topology
from rlsdk.observe.logging import get_logger

if TYPE_CHECKING:
    from rlsdk.config import LaunchConfig

logger = get_logger(__name__)

# The shell variable the script sets to the first host of the allocation (machine rank 0).
MAIN_IP_VAR = "RLSDK_MAIN_PROCESS_IP"


@dataclass(frozen=True)
class SlurmJobSpec:
    """Everything the generated script depends on; pure data, so scripts are reproducible and snapshot-tested.

    Attributes:
        num_nodes: ``--nodes``; one srun task per node.
        ranks_per_node: Train ranks accelerate starts on each node (``--num_processes`` is the total).
        main_process_port: Rendezvous port on machine rank 0.
        output_path: ``--output`` of the job (``%j`` = job id); the controller tails it.
        python: The interpreter on the compute nodes (the controller's; a shared filesystem is assumed).
        cpus_per_task: ``--cpus-per-task``.
        time: ``--time``.
        job_name: ``--job-name``.
        partition / account: ``--partition`` / ``--account``; None = omitted (the cluster's defaults).
        gpus_per_node: ``--gpus-per-node``; 0 = omitted (CPU ranks, gloo).
        module: The rank entry point (``python -m``).
    """

    num_nodes: int
    ranks_per_node: int
    main_process_port: int
    output_path: str
    python: str
    cpus_per_task: int
    time: str = "01:00:00"
    job_name: str = "rlsdk-train"
    partition: str | None = None
    account: str | None = None
    gpus_per_node: int = 0
    module: str = "rlsdk.worker"

    @classmethod
    def from_config(
        cls, launch: LaunchConfig, *, main_process_port: int, output_path: str, python: str | None = None
    ) -> SlurmJobSpec:
        topology = Topology.from_config(launch)
        return cls(
            num_nodes=topology.num_nodes,
            ranks_per_node=topology.ranks_per_node,
            main_process_port=main_process_port,
            output_path=output_path,
            python=python or sys.executable,
            cpus_per_task=launch.slurm_cpus_per_task or launch.threads_per_rank * topology.ranks_per_node,
            time=launch.slurm_time,
            partition=launch.slurm_partition,
            account=launch.slurm_account,
            gpus_per_node=launch.gpus_per_node,
        )


def node_command(spec: SlurmJobSpec, machine_rank_var: str = "SLURM_NODEID") -> str:
    """The shell command each srun task runs: ``accelerate launch`` for this node's ranks.

    ``$SLURM_NODEID`` (set by srun per node; ``machine_rank_var`` names another variable, as the Ray launcher
    does) is the machine rank; ``$RLSDK_MAIN_PROCESS_IP`` is set by the script from the allocation. Both are
    expanded on the node, never at generation time.
    """
    head = [
        spec.python, "-m", "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes", str(spec.num_nodes * spec.ranks_per_node),
        "--num_machines", str(spec.num_nodes),
    ]  # fmt: skip
    tail = [
        "--main_process_port", str(spec.main_process_port),
        "--same_network",
        "--mixed_precision", "no",
        "--dynamo_backend", "no",
        "-m", spec.module,
    ]  # fmt: skip
    node = f'--machine_rank "${machine_rank_var}" --main_process_ip "${MAIN_IP_VAR}"'
    return f"exec {shlex.join(head)} {node} {shlex.join(tail)}"


def sbatch_script(spec: SlurmJobSpec) -> str:
    """The batch script: the allocation's ``#SBATCH`` lines, the rendezvous host, one srun step over all nodes."""
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={spec.num_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={spec.cpus_per_task}",
        f"#SBATCH --time={spec.time}",
    ]
    if spec.partition is not None:
        lines.append(f"#SBATCH --partition={spec.partition}")
    if spec.account is not None:
        lines.append(f"#SBATCH --account={spec.account}")
    if spec.gpus_per_node > 0:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    lines += [
        f"#SBATCH --output={spec.output_path}",
        "#SBATCH --export=ALL",
        "# Generated by rlsdk.launch.slurm; the controller's environment (control address, session secret) is",
        "# inherited through --export=ALL and never written here.",
        "set -euo pipefail",
        f'{MAIN_IP_VAR}="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"',
        f"export {MAIN_IP_VAR}",
        f'echo "rlsdk: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous ${MAIN_IP_VAR}:{spec.main_process_port}"',
        f"srun --nodes={spec.num_nodes} --ntasks-per-node=1 --cpus-per-task={spec.cpus_per_task} \\",
        "    --kill-on-bad-exit=1 --label \\",
        f"    bash -c {shlex.quote(node_command(spec))}",
        "",
    ]
    return "\n".join(lines)


def free_port(host: str = "") -> int:
    """A TCP port free on this machine now (best effort on the nodes: the job binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def launcher_error(
    returncode: int | None, last_lines: Iterable[str], rank_log_lines: Callable[[int], Iterable[str]] | None
) -> RankProcessError:
    """A :class:`RankProcessError` for a cluster launcher, with the failed rank's log lines when named."""
    error = RankProcessError(returncode, last_lines)
    if rank_log_lines is None or error.failed_rank is None:
        return error
    return RankProcessError(returncode, last_lines, rank_log_lines=rank_log_lines(error.failed_rank))


def parse_job_id(line: str) -> str:
    """The job id from ``sbatch --parsable`` output (``ID`` or ``ID;CLUSTER``)."""
    job_id = line.strip().split(";")[0]
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch printed {line!r}; expected a job id (sbatch --parsable)")
    return job_id


class SlurmLauncher:
    """The ranks as one Slurm job; the same interface as :class:`~rlsdk.launch.local.LocalLauncher`.

    ``proc`` is the ``sbatch --wait`` process: it exits when the job ends. ``stop`` cancels the job (``scancel``)
    and then ends that process. Rank pids are only signalled directly when every node is this machine
    (``simulate_nodes_on_loopback``); on a cluster they are other machines' pids.
    """

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        output_path: Path,
        on_line: Callable[[str], None] | None,
        *,
        local_ranks: bool,
    ) -> None:
        self.proc = proc
        self.output_path = output_path
        self.job_id: str | None = None
        self.last_lines: deque[str] = deque(maxlen=200)
        self._rank_pids: list[int] = []
        self._on_line = on_line
        self._local_ranks = local_ranks
        self._job_known = asyncio.Event()
        self._reader = asyncio.get_running_loop().create_task(self._read_output())

    @classmethod
    async def start(
        cls,
        launch: LaunchConfig,
        env: Mapping[str, str],
        *,
        job_dir: Path,
        on_line: Callable[[str], None] | None = None,
        main_process_port: int | None = None,
    ) -> SlurmLauncher:
        """Write the script under ``job_dir``, submit it and return once sbatch printed the job id."""
        if shutil.which("sbatch", path=env.get("PATH")) is None:
            raise RuntimeError(
                "launch.scheduler='slurm' needs sbatch on PATH (a Slurm login node); none found. On one machine, "
                "rlsdk.testing.fake_slurm.install_fake_slurm simulates one"
            )
        job_dir.mkdir(parents=True, exist_ok=True)
        port = main_process_port or launch.main_process_port or free_port()
        output_path = job_dir / "slurm-%j.out"
        spec = SlurmJobSpec.from_config(launch, main_process_port=port, output_path=str(output_path))
        script = job_dir / "train.sbatch"
        script.write_text(sbatch_script(spec))
        cmd = [sys.executable, "-m", "rlsdk.launch.pdeathsig", "sbatch", "--wait", "--parsable", str(script)]
        logger.info(
            "submitting %s: %d nodes x %d ranks, rendezvous port %d", script, spec.num_nodes, spec.ranks_per_node, port
        )
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            env=dict(env),
            cwd=str(job_dir),
        )
        launcher = cls(proc, output_path, on_line, local_ranks=launch.simulate_nodes_on_loopback)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(launcher._job_known.wait(), timeout=60.0)
        if launcher.job_id is None and proc.returncode is None:
            logger.warning("sbatch printed no job id within 60 s; the job cannot be cancelled by id")
        return launcher

    async def _read_output(self) -> None:
        """sbatch's own output (the job id first), then the job's output file until sbatch exits."""
        assert self.proc.stdout is not None
        first = await self.proc.stdout.readline()
        if first:
            try:
                self.job_id = parse_job_id(first.decode(errors="replace"))
                logger.info("slurm job %s submitted", self.job_id)
            except RuntimeError as exc:
                self._emit(str(exc))
        self._job_known.set()
        drain = asyncio.get_running_loop().create_task(self._drain_sbatch())
        path = Path(str(self.output_path).replace("%j", self.job_id or "unknown"))
        offset, partial = 0, b""
        while True:
            done = self.proc.returncode is not None
            with contextlib.suppress(FileNotFoundError):
                with path.open("rb") as handle:
                    handle.seek(offset)
                    chunk = handle.read()
                offset += len(chunk)
                *complete, partial = (partial + chunk).split(b"\n")
                for raw in complete:
                    self._emit(raw.decode(errors="replace").rstrip())
            if done:
                break
            await asyncio.sleep(0.2)
        if partial:
            self._emit(partial.decode(errors="replace").rstrip())
        await drain

    async def _drain_sbatch(self) -> None:
        assert self.proc.stdout is not None
        while raw := await self.proc.stdout.readline():
            self._emit(raw.decode(errors="replace").rstrip())
        await self.proc.wait()

    def _emit(self, line: str) -> None:
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
        """Wait for the job (the ``sbatch --wait`` process) to end, output drained; returns its exit code."""
        code = await self.proc.wait()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._reader), timeout=2.0)
        return code

    def error(self, rank_log_lines: Callable[[int], Iterable[str]] | None = None) -> RankProcessError:
        """The job's exit as an error; ``rank_log_lines(rank)`` adds the failed rank's last log lines."""
        return launcher_error(self.proc.returncode, self.last_lines, rank_log_lines)

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """``scancel`` the job, then end the sbatch process (SIGTERM, SIGKILL after ``grace_s``). Idempotent."""
        if self.job_id is not None and self.proc.returncode is None:
            await _scancel(self.job_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout=grace_s)
        if self.proc.returncode is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout=grace_s)
            except TimeoutError:
                logger.warning("sbatch did not stop within %.0f s; killing it", grace_s)
                _signal_group(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        await _reap_ranks(self.rank_pids, grace_s=min(grace_s, 5.0))
        if not self._reader.done():
            with contextlib.suppress(asyncio.CancelledError, TimeoutError, Exception):
                await asyncio.wait_for(self._reader, timeout=2.0)
        return self.proc.returncode


async def _scancel(job_id: str) -> None:
    try:
        proc = await asyncio.create_subprocess_exec(
            "scancel", job_id, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        _, err = await asyncio.wait_for(proc.communicate(), timeout=30.0)
    except (OSError, TimeoutError) as exc:
        logger.warning("scancel %s failed: %s", job_id, exc)
        return
    if proc.returncode:
        logger.warning("scancel %s exited %s: %s", job_id, proc.returncode, err.decode(errors="replace").strip())
