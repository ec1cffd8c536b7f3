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

vLLM replicas (``inference.engine='vllm'`` without ``inference.vllm.url``: :func:`rlsdk.launch.select.start_launcher`
is given the engine's :class:`~rlsdk.procutil.ReplicaServer`): the allocation grows by one node per replica (after
the train nodes); the script starts each replica's server (the command rlsdk's local launcher runs, built by
:func:`rlsdk.engine.inference.vllm_server.replica_server`) with srun on its node, in the background, through
:mod:`rlsdk.launch.vllm_replica`, which writes the replica's endpoint to
``OUTPUT/launch/slurm/endpoints/replica-R.json`` once it is healthy; the controller polls that file
(:meth:`SlurmLauncher.wait_for_endpoint`) and attaches to the server by URL. A replica listens on its node's name, so it
is reachable from the cluster network: every route but ``/health`` requires the job's own bearer token
(:mod:`rlsdk.engine.inference.vllm_auth`), which reaches the server through the job's environment
(``ReplicaServer.token_env``, vLLM's ``VLLM_API_KEY``, with ``--export=ALL`` like the session secret), never the script
or the endpoint file. Only one replica runs end to end: routing over several is not implemented, and ``start_launcher``
refuses ``inference_replicas > 1``.

What is not run here: a real Slurm cluster. The generated scripts are snapshot-tested; the simulation runs them
(with a stand-in for the vLLM server in the endpoint test).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rlsdk.launch.supervised import SupervisedLauncher
from rlsdk.launch.topology import Topology
from rlsdk.observe.logging import get_logger
from rlsdk.procutil import ReplicaServer, free_port, start_in_own_session

if TYPE_CHECKING:
    from rlsdk.config import LaunchConfig

logger = get_logger(__name__)

# The shell variable the script sets to the first host of the allocation (machine rank 0).
MAIN_IP_VAR = "RLSDK_MAIN_PROCESS_IP"


# Where the replicas' endpoint files go, under the job directory.
ENDPOINTS_DIR = "endpoints"


@dataclass(frozen=True)
class VllmReplicaSpec:
    """vLLM servers on their own nodes of the job: one node per replica, after the train nodes.

    Attributes:
        replicas: Number of replicas (``launch.inference_replicas``); one node each (a replica's
            ``inference_tensor_parallel_size`` GPUs fit on one node: the config checks it).
        server_command: The server's command line without ``--host``/``--port`` (the replica wrapper,
            :mod:`rlsdk.launch.vllm_replica`, appends the node's name and a port free there), its environment as
            a leading ``env K=V ...``.
        endpoint_dir: Where each replica's wrapper writes ``replica-R.json`` once healthy (shared with the
            controller).
        start_timeout_s: Seconds a replica's server may take to become healthy
            (``inference.vllm.server_start_timeout_s``).
        token: The bearer token every replica requires (fresh per spec; exported to the job, never written).
        token_env: The variable the replicas read the token from (vLLM's ``VLLM_API_KEY``).
    """

    replicas: int
    server_command: tuple[str, ...]
    endpoint_dir: str
    start_timeout_s: float = 300.0
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    token_env: str = "VLLM_API_KEY"

    @classmethod
    def from_server(cls, server: ReplicaServer, *, endpoint_dir: str) -> VllmReplicaSpec:
        """The replicas of ``server`` (the engine's description, :func:`rlsdk.engine.inference.factory.
        replica_server`), each writing its endpoint under ``endpoint_dir``, with a fresh token."""
        return cls(
            replicas=server.replicas,
            server_command=server.command,
            endpoint_dir=endpoint_dir,
            start_timeout_s=server.start_timeout_s,
            token_env=server.token_env,
        )


def endpoint_path(endpoint_dir: str | Path, replica: int) -> Path:
    """The endpoint file replica ``replica`` writes once healthy."""
    return Path(endpoint_dir) / f"replica-{replica}.json"


def replica_command(spec: SlurmJobSpec, replica: int, host_var: str) -> str:
    """The srun task of vLLM replica ``replica``: the endpoint-reporting wrapper around the server command.
    ``$host_var`` (the replica's node from the allocation) is expanded by the batch script."""
    assert spec.vllm is not None
    head = [
        spec.python, "-m", "rlsdk.launch.vllm_replica",
        "--replica", str(replica),
        "--endpoint-file", str(endpoint_path(spec.vllm.endpoint_dir, replica)),
    ]  # fmt: skip
    tail = ["--start-timeout-s", f"{spec.vllm.start_timeout_s:g}", "--", *spec.vllm.server_command]
    return f'{shlex.join(head)} --host "${host_var}" {shlex.join(tail)}'


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
        vllm: vLLM replicas on nodes of their own (``--nodes`` grows by ``vllm.replicas``); None = none.
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
    vllm: VllmReplicaSpec | None = None

    @classmethod
    def from_config(
        cls,
        launch: LaunchConfig,
        *,
        main_process_port: int,
        output_path: str,
        python: str | None = None,
        vllm: VllmReplicaSpec | None = None,
    ) -> SlurmJobSpec:
        topology = Topology.from_config(launch)
        return cls(
            num_nodes=topology.num_nodes,
            ranks_per_node=topology.ranks_per_node,
            main_process_port=main_process_port,
            output_path=output_path,
            python=python or sys.executable,
            cpus_per_task=launch.slurm.cpus_per_task or launch.threads_per_rank * topology.ranks_per_node,
            time=launch.slurm.time,
            partition=launch.slurm.partition,
            account=launch.slurm.account,
            gpus_per_node=launch.gpus_per_node,
            vllm=vllm,
        )

    @property
    def total_nodes(self) -> int:
        """``--nodes`` of the allocation: the train nodes, then one per vLLM replica."""
        return self.num_nodes + (self.vllm.replicas if self.vllm is not None else 0)


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
    """The batch script: the allocation's ``#SBATCH`` lines, the rendezvous host, one srun step over the train
    nodes and, with ``spec.vllm``, one background srun step per vLLM replica on the nodes after them."""
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={spec.total_nodes}",
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
    ]
    train_nodelist = ""
    if spec.vllm is not None:
        hosts = 'scontrol show hostnames "$SLURM_JOB_NODELIST"'
        lines += [
            f"# vLLM replicas: one node each after the {spec.num_nodes} train node(s), in the background; each writes",
            f"# its endpoint to {spec.vllm.endpoint_dir}/replica-R.json once healthy (the controller polls it).",
        ]
        for replica in range(spec.vllm.replicas):
            node = spec.num_nodes + replica + 1
            var = f"RLSDK_VLLM_NODE_{replica}"
            lines += [
                f'{var}="$({hosts} | sed -n {node}p)"',
                f'srun --nodes=1 --ntasks=1 --nodelist="${var}" --cpus-per-task={spec.cpus_per_task} \\',
                "    --kill-on-bad-exit=1 --label \\",
                f"    {replica_command(spec, replica, var)} &",
            ]
        lines += [
            "# The replicas end with the training step (a real allocation would end them too, with the job).",
            "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT",
            f'RLSDK_TRAIN_NODES="$({hosts} | head -n {spec.num_nodes} | paste -sd, -)"',
        ]
        train_nodelist = ' --nodelist="$RLSDK_TRAIN_NODES"'
    lines += [
        f"srun --nodes={spec.num_nodes}{train_nodelist} --ntasks-per-node=1 --cpus-per-task={spec.cpus_per_task} \\",
        "    --kill-on-bad-exit=1 --label \\",
        f"    bash -c {shlex.quote(node_command(spec))}",
        "",
    ]
    return "\n".join(lines)


def parse_job_id(line: str) -> str:
    """The job id from ``sbatch --parsable`` output (``ID`` or ``ID;CLUSTER``)."""
    job_id = line.strip().split(";")[0]
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch printed {line!r}; expected a job id (sbatch --parsable)")
    return job_id


class SlurmLauncher(SupervisedLauncher):
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
        super().__init__(proc, on_line, local_ranks=local_ranks)
        self.output_path = output_path
        self.job_id: str | None = None
        self._job_known = asyncio.Event()
        self._read_output(self._read_job_output())
        self.vllm: VllmReplicaSpec | None = None  # the job's vLLM replicas (set by start())

    @classmethod
    async def start(
        cls,
        launch: LaunchConfig,
        env: Mapping[str, str],
        *,
        job_dir: Path,
        on_line: Callable[[str], None] | None = None,
        main_process_port: int | None = None,
        vllm: VllmReplicaSpec | None = None,
    ) -> SlurmLauncher:
        """Write the script under ``job_dir``, submit it and return once sbatch printed the job id.

        ``vllm``: replicas to start on nodes of their own; their endpoints come back through
        :meth:`wait_for_endpoint` (stale endpoint files of an earlier job are removed first).
        """
        if shutil.which("sbatch", path=env.get("PATH")) is None:
            raise RuntimeError(
                "launch.scheduler='slurm' needs sbatch on PATH (a Slurm login node); none found. On one machine, "
                "rlsdk.testing.fake_slurm.install_fake_slurm simulates one"
            )
        from rlsdk.runtime_dir import private_dir

        private_dir(job_dir)  # the script, the job's output and the replicas' endpoints: this user's only
        port = main_process_port or launch.main_process_port or free_port()
        output_path = job_dir / "slurm-%j.out"
        spec = SlurmJobSpec.from_config(launch, main_process_port=port, output_path=str(output_path), vllm=vllm)
        if vllm is not None:
            for replica in range(vllm.replicas):
                endpoint_path(vllm.endpoint_dir, replica).unlink(missing_ok=True)
        script = job_dir / "train.sbatch"
        script.write_text(sbatch_script(spec))
        cmd = [sys.executable, "-m", "rlsdk.launch.pdeathsig", "sbatch", "--wait", "--parsable", str(script)]
        logger.info(
            "submitting %s: %d nodes x %d ranks, rendezvous port %d", script, spec.num_nodes, spec.ranks_per_node, port
        )
        job_env = dict(env)
        if vllm is not None:
            job_env[vllm.token_env] = vllm.token  # the replicas' token: inherited through --export=ALL, never written
        proc = await start_in_own_session(cmd, job_env, cwd=str(job_dir))
        launcher = cls(proc, output_path, on_line, local_ranks=launch.simulate_nodes_on_loopback)
        launcher.vllm = vllm
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(launcher._job_known.wait(), timeout=60.0)
        if launcher.job_id is None and proc.returncode is None:
            logger.warning("sbatch printed no job id within 60 s; the job cannot be cancelled by id")
        return launcher

    @property
    def vllm_replicas(self) -> int:
        """vLLM replicas this job starts on nodes of their own (0: none; the Session starts or attaches one)."""
        return self.vllm.replicas if self.vllm is not None else 0

    @property
    def vllm_token(self) -> str | None:
        """The bearer token this job's vLLM replicas require (None: the job starts none)."""
        return self.vllm.token if self.vllm is not None else None

    async def wait_for_endpoint(self, replica: int = 0, *, timeout_s: float) -> str:
        """The base URL (``http://NODE:PORT``) of vLLM replica ``replica`` once its server is healthy.

        Polls the endpoint file the replica's wrapper writes (:mod:`rlsdk.launch.vllm_replica`). Raises
        RuntimeError (with the job's last lines) when the wrapper reports that its server failed to start,
        :class:`~rlsdk.launch.supervised.RankProcessError` when the job ends first, ``TimeoutError`` after
        ``timeout_s`` (which must cover the job's wait in the queue and the server's start-up), ValueError when
        this job starts no such replica.
        """
        if not 0 <= replica < self.vllm_replicas:
            raise ValueError(f"replica {replica}: this Slurm job starts {self.vllm_replicas} vLLM replica(s)")
        assert self.vllm is not None
        path = endpoint_path(self.vllm.endpoint_dir, replica)
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                record = json.loads(path.read_text())
                if self.job_id is None or record.get("job_id") in (None, self.job_id):
                    if "error" in record:
                        await asyncio.sleep(0.5)  # the output reader polls every 0.2 s: let it catch the last lines
                        tail = "\n".join(list(self.last_lines)[-20:]) or "(no output)"
                        raise RuntimeError(
                            f"vLLM replica {replica} of slurm job {self.job_id} failed: {record['error']}. Last job "
                            f"lines:\n{tail}"
                        )
                    logger.info("vLLM replica %d of slurm job %s serves at %s", replica, self.job_id, record["url"])
                    return str(record["url"])
            if self.proc.returncode is not None:
                error = self.error()
                error.add_note(f"the Slurm job ended before vLLM replica {replica} wrote its endpoint to {path}")
                raise error
            if time.monotonic() > deadline:
                tail = "\n".join(list(self.last_lines)[-20:]) or "(no output)"
                raise TimeoutError(
                    f"vLLM replica {replica} of slurm job {self.job_id} wrote no endpoint to {path} within "
                    f"{timeout_s:.0f} s (job still queued, or its server not healthy). Last job lines:\n{tail}"
                )
            await asyncio.sleep(0.2)

    async def _read_job_output(self) -> None:
        """sbatch's own output (the job id first), then the job's output file until sbatch exits."""
        assert self.proc.stdout is not None
        first = await self.proc.stdout.readline()
        if first:
            try:
                self.job_id = parse_job_id(first.decode(errors="replace"))
                logger.info("slurm job %s submitted", self.job_id)
            except RuntimeError as exc:
                self.emit(str(exc))
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
                    self.emit(raw.decode(errors="replace").rstrip())
            if done:
                break
            await asyncio.sleep(0.2)
        if partial:
            self.emit(partial.decode(errors="replace").rstrip())
        await drain

    async def _drain_sbatch(self) -> None:
        assert self.proc.stdout is not None
        while raw := await self.proc.stdout.readline():
            self.emit(raw.decode(errors="replace").rstrip())
        await self.proc.wait()

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """``scancel`` the job, then end the sbatch process (SIGTERM, SIGKILL after ``grace_s``). Idempotent."""
        if self.job_id is not None and self.proc.returncode is None:
            await _scancel(self.job_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout=grace_s)
        # The reader gets up to 2 s to read the job's last lines from its output file.
        await self._stop_process(grace_s, "sbatch", reader_grace_s=2.0)
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
