"""Start the train ranks on an existing Ray cluster: one placement-group bundle per node, one launch per bundle.

``ray`` is an optional extra (``pip install 'rlsdk[ray]'``) and is imported only inside the functions that use
it. The controller connects with ``ray.init(address=launch.ray.address or 'auto')``, reserves a placement group
of ``num_nodes`` bundles (``STRICT_SPREAD``: one per node; ``PACK`` when ``simulate_nodes_on_loopback`` lets all
bundles share this machine), and starts one small actor per bundle. Actor 0 reports its node's IP, which becomes
``--main_process_ip``; each actor then runs the same ``accelerate launch --machine_rank i`` command as the Slurm
path (:func:`rlsdk.launch.slurm.node_command`, the machine rank in ``$RLSDK_MACHINE_RANK``).

vLLM replicas get their own placement groups (:func:`inference_bundles`: one ``STRICT_PACK`` group per replica,
so a replica's tensor-parallel GPUs share a node), which vLLM's Ray executor uses when started inside them.

The controller disconnects from Ray on :meth:`RayLauncher.stop` only when the launcher connected it (a notebook
that called ``ray.init`` itself stays connected).

Tested on a local Ray instance (tests/launch/test_ray.py: two simulated nodes, ``PACK`` on one machine, one
training step and a verified sync; skipped with a reason where the ``ray`` extra is not installed). Not run here:
a multi-machine Ray cluster, so ``STRICT_SPREAD`` placement and cross-node rendezvous are unexercised.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rlsdk.launch.slurm import MAIN_IP_VAR, SlurmJobSpec, node_command
from rlsdk.launch.supervised import LAST_LINES, SupervisedLauncher
from rlsdk.launch.topology import Topology
from rlsdk.observe.logging import get_logger
from rlsdk.procutil import free_port, signal_group

if TYPE_CHECKING:
    from rlsdk.config import LaunchConfig

logger = get_logger(__name__)

# The variable each node launcher sets to its machine rank (Slurm's SLURM_NODEID is not faked outside Slurm).
MACHINE_RANK_VAR = "RLSDK_MACHINE_RANK"


def train_bundles(launch: LaunchConfig) -> tuple[list[dict[str, float]], str]:
    """``(bundles, strategy)`` of the train placement group: one bundle per node with its ranks' CPUs and GPUs."""
    topology = Topology.from_config(launch)
    bundle: dict[str, float] = {"CPU": float(launch.threads_per_rank * topology.ranks_per_node)}
    if launch.gpus_per_node > 0:
        bundle["GPU"] = float(topology.ranks_per_node)
    strategy = "PACK" if launch.simulate_nodes_on_loopback or topology.num_nodes == 1 else "STRICT_SPREAD"
    return [dict(bundle) for _ in range(topology.num_nodes)], strategy


def inference_bundles(launch: LaunchConfig) -> list[tuple[list[dict[str, float]], str]]:
    """One ``(bundles, 'STRICT_PACK')`` per vLLM replica: a bundle per tensor-parallel GPU (CPU-only: one bundle)."""
    if launch.gpus_per_node > 0:
        bundles = [{"GPU": 1.0, "CPU": 1.0} for _ in range(launch.inference_tensor_parallel_size)]
    else:
        bundles = [{"CPU": 1.0}]
    return [([dict(b) for b in bundles], "STRICT_PACK") for _ in range(launch.inference_replicas)]


class _RayJob:
    """The launch's supervising 'process': finishes when every node's launch has returned."""

    def __init__(self, task: asyncio.Task[int]) -> None:
        self._task = task
        self.pid = -1

    @property
    def returncode(self) -> int | None:
        if not self._task.done():
            return None
        return self._task.result() if not self._task.cancelled() and self._task.exception() is None else 1

    async def wait(self) -> int:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.shield(self._task)
        code = self.returncode
        return 1 if code is None else code


class RayLauncher(SupervisedLauncher):
    """The ranks as Ray actors, one per placement-group bundle; the interface of LocalLauncher."""

    def __init__(
        self,
        actors: list[Any],
        placement_group: Any,
        pending: list[Any],
        on_line: Callable[[str], None] | None,
        *,
        local_ranks: bool,
        owns_connection: bool = False,
    ) -> None:
        # The job's output: each node launch's last lines, emitted as it returns (_run).
        job = _RayJob(asyncio.get_running_loop().create_task(self._run(pending)))
        super().__init__(job, on_line, local_ranks=local_ranks)
        self.actors = actors
        self.actor_pids: list[int] = []  # the node launchers' worker processes (filled by start())
        self._owns_connection = owns_connection
        self.placement_group = placement_group

    @classmethod
    async def start(
        cls, launch: LaunchConfig, env: Mapping[str, str], *, on_line: Callable[[str], None] | None = None
    ) -> RayLauncher:
        """Connect to the cluster, reserve the placement group, start one node launcher per bundle."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        owns_connection = not ray.is_initialized()
        ray.init(address=launch.ray.address or "auto", ignore_reinit_error=True, log_to_driver=False)
        bundles, strategy = train_bundles(launch)
        group = placement_group(bundles, strategy=strategy, name="rlsdk-train")
        actors: list[Any] = []
        try:
            await asyncio.wait_for(group.ready(), timeout=launch.start_timeout_s)
            node_launcher = ray.remote(_NodeLauncher)
            actors += [
                node_launcher.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    max_concurrency=2,  # terminate() must run while run() blocks
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=index
                    ),
                ).remote()
                for index, bundle in enumerate(bundles)
            ]
            main_ip = await actors[0].node_ip.remote()
            port = launch.main_process_port or await actors[0].free_port.remote()
            spec = SlurmJobSpec.from_config(launch, main_process_port=port, output_path="", python=sys.executable)
            command = node_command(spec, machine_rank_var=MACHINE_RANK_VAR)
            pending = [
                actor.run.remote(command, {**env, MACHINE_RANK_VAR: str(index), MAIN_IP_VAR: main_ip})
                for index, actor in enumerate(actors)
            ]
            launcher = cls(
                actors,
                group,
                pending,
                on_line,
                local_ranks=launch.simulate_nodes_on_loopback,
                owns_connection=owns_connection,
            )
            launcher.actor_pids = list(await asyncio.gather(*(actor.pid.remote() for actor in actors)))
        except BaseException:
            # Nothing reserved may outlive a failed start (a notebook's driver stays connected).
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            with contextlib.suppress(Exception):
                remove_placement_group(group)
            if owns_connection:
                ray.shutdown()
            raise
        launcher.emit(f"ray: {len(actors)} node launchers ({strategy}), rendezvous {main_ip}:{port}")
        return launcher

    async def _run(self, pending: list[Any]) -> int:
        worst = 0
        for ref in pending:
            code, tail = await ref
            for line in tail:
                self.emit(line)
            worst = worst or code
        return worst

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """Kill the node launchers (their ranks die with them, PR_SET_PDEATHSIG), free the placement group and,
        when :meth:`start` connected this process to Ray, disconnect it. Idempotent."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(actor.terminate.remote(grace_s), timeout=grace_s + 5.0)
            with contextlib.suppress(Exception):
                ray.kill(actor)
        with contextlib.suppress(Exception):
            remove_placement_group(self.placement_group)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.proc.wait(), timeout=grace_s)
        if self._owns_connection and ray.is_initialized():
            ray.shutdown()
        self._owns_connection = False
        return self.proc.returncode


class _NodeLauncher:
    """A Ray actor on one node: runs that node's ``accelerate launch`` (made remote with ``ray.remote``)."""

    def __init__(self) -> None:
        self._proc: Any = None

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def free_port(self) -> int:
        return free_port()

    def pid(self) -> int:
        import os

        return os.getpid()

    def run(self, command: str, env: dict[str, str]) -> tuple[int, list[str]]:
        import subprocess

        wrapped = [sys.executable, "-m", "rlsdk.launch.pdeathsig", "bash", "-c", command]
        self._proc = subprocess.Popen(
            wrapped, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        tail: deque[str] = deque(maxlen=LAST_LINES)
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            tail.append(raw.decode(errors="replace").rstrip())
        return self._proc.wait(), list(tail)

    def terminate(self, grace_s: float) -> None:
        import signal
        import subprocess

        if self._proc is None or self._proc.poll() is not None:
            return
        signal_group(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            signal_group(self._proc.pid, signal.SIGKILL)
