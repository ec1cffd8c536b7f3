"""Pick the launcher ``launch.scheduler`` names and start the train ranks with it.

Every launcher has the interface the Session uses (:class:`Launcher`); 'local' is exactly the single-machine
:class:`~rlsdk.launch.local.LocalLauncher` the Session started before schedulers existed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlsdk.config.errors import ConfigError
from rlsdk.launch.local import LocalLauncher
from rlsdk.launch.supervised import RankProcessError

if TYPE_CHECKING:
    from rlsdk.config import LaunchConfig
    from rlsdk.procutil import ReplicaServer


class Launcher(Protocol):
    """What the Session needs from a launcher: the supervising process, its exit, errors and a clean stop.

    ``rank_pids`` is set by the Session once the ranks said hello, and read back before it signals them: a
    cluster launcher returns only pids of this machine (none on a real cluster).
    """

    proc: asyncio.subprocess.Process
    last_lines: deque[str]
    rank_pids: list[int]

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def error(self, rank_log_lines: Callable[[int], Iterable[str]] | None = None) -> RankProcessError: ...

    async def stop(self, grace_s: float = 10.0) -> int | None: ...


def check_runnable(launch: LaunchConfig) -> None:
    """Raise ConfigError for a topology the config accepts but this release cannot run.

    The train engine implements data parallelism only (``train.parallelism`` 'ddp' or 'fsdp2'); tensor and
    context parallel axes are declared (and the device mesh built for them, rlsdk/launch/topology.py) but no
    model code shards over them yet. One inference replica only: the engine talks to one server, and routing
    requests over several replicas is not written (the Slurm launcher can generate their commands).
    """
    # TODO(issue 9): wire tensor/context parallel axes into TrainEngine; until then refuse them at start.
    if launch.tensor_parallel_size > 1:
        raise ConfigError(
            "LaunchConfig.tensor_parallel_size",
            launch.tensor_parallel_size,
            "1 in this release (the train engine is data parallel only: train.parallelism 'ddp' or 'fsdp2')",
        )
    if launch.context_parallel_size > 1:
        raise ConfigError(
            "LaunchConfig.context_parallel_size",
            launch.context_parallel_size,
            "1 in this release (the train engine is data parallel only: train.parallelism 'ddp' or 'fsdp2')",
        )
    # TODO(issue 9): route requests over several vLLM replicas; until then one replica runs end to end.
    if launch.inference_replicas > 1:
        raise ConfigError(
            "LaunchConfig.inference_replicas",
            launch.inference_replicas,
            "1 in this release: routing requests over several vLLM replicas is not implemented yet (the slurm "
            "scheduler generates their commands, rlsdk.launch.slurm.sbatch_script, but a Session uses one server)",
        )


async def start_launcher(
    launch: LaunchConfig,
    env: Mapping[str, str],
    *,
    output_dir: Path,
    on_line: Callable[[str], None] | None = None,
    replica_server: ReplicaServer | None = None,
) -> Any:
    """Start the train ranks with the launcher of ``launch.scheduler``; returns a :class:`Launcher`.

    'local': ``accelerate launch`` on this machine. 'slurm': an sbatch job whose script and output lie under
    ``output_dir/launch/slurm``; given the inference engine's ``replica_server`` (vLLM's, when it attaches to no
    ``inference.vllm.url``), the job also runs it on a node of its own (the launcher's ``wait_for_endpoint`` gives
    its URL); the local and Ray launchers leave it to the engine, which starts its server on this machine. 'ray':
    placement groups on the Ray cluster at ``launch.ray.address``. Raises ConfigError for a topology this release
    cannot run (see :func:`check_runnable`).
    """
    check_runnable(launch)
    if launch.scheduler == "local":
        return await LocalLauncher.start(launch.num_ranks, env, on_line=on_line)
    if launch.scheduler == "slurm":
        from rlsdk.launch.slurm import ENDPOINTS_DIR, SlurmLauncher, VllmReplicaSpec

        job_dir = output_dir / "launch" / "slurm"
        vllm = None
        if replica_server is not None:
            vllm = VllmReplicaSpec.from_server(replica_server, endpoint_dir=str(job_dir / ENDPOINTS_DIR))
        return await SlurmLauncher.start(launch, env, job_dir=job_dir, on_line=on_line, vllm=vllm)
    from rlsdk.launch.ray import RayLauncher

    return await RayLauncher.start(launch, env, on_line=on_line)
