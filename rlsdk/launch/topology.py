"""The run's topology: nodes, ranks per node, parallel sizes, and the device mesh that matches them.

Pure functions of :class:`~rlsdk.config.LaunchConfig` (plus the train engine's ``parallelism``), so launchers,
ranks and tests agree on one layout. Vocabulary (as in torchtitan): an *axis* is a device-mesh axis, a *dim* a
tensor dimension. Mesh axes, outermost first:

- ``dp_replicate`` (``parallelism='ddp'``) or ``dp_shard`` (``'fsdp2'``): data parallel, size
  ``data_parallel_size``;
- ``cp``: context parallel, ``context_parallel_size``;
- ``tp``: tensor parallel, ``tensor_parallel_size`` (innermost, so a tensor-parallel group is consecutive ranks,
  i.e. on one node when it fits there).

Expert axes (``ep``, expert-tensor) are a documented extension: they would split the ``dp_shard`` x ``cp`` axes
as torchtitan does, and are not declared yet because no engine here runs mixture-of-experts models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from rlsdk.config import LaunchConfig


@dataclass(frozen=True)
class Topology:
    """Where every train rank and inference replica goes. Build it with :meth:`from_config`.

    Attributes:
        num_nodes: Machines the train ranks span.
        ranks_per_node: Train ranks on each node; ``world_size = num_nodes x ranks_per_node``.
        data_parallel_size / context_parallel_size / tensor_parallel_size: Mesh axis sizes; their product is
            the world size.
        inference_replicas: vLLM replicas, each ``inference_tensor_parallel_size`` GPUs.
        parallelism: The train engine's data-parallel flavour: 'ddp' (replicate) or 'fsdp2' (shard).
    """

    num_nodes: int
    ranks_per_node: int
    data_parallel_size: int
    context_parallel_size: int
    tensor_parallel_size: int
    inference_replicas: int = 1
    inference_tensor_parallel_size: int = 1
    parallelism: Literal["ddp", "fsdp2"] = "ddp"

    def __post_init__(self) -> None:
        product = self.data_parallel_size * self.context_parallel_size * self.tensor_parallel_size
        if product != self.world_size:
            raise ValueError(
                f"mesh axes dp x cp x tp = {self.data_parallel_size} x {self.context_parallel_size} x "
                f"{self.tensor_parallel_size} = {product} != world size num_nodes x ranks_per_node = "
                f"{self.num_nodes} x {self.ranks_per_node} = {self.world_size}"
            )

    @classmethod
    def from_config(cls, launch: LaunchConfig, parallelism: Literal["ddp", "fsdp2"] = "ddp") -> Topology:
        """The topology a validated LaunchConfig declares (its __post_init__ already checked the arithmetic)."""
        ranks_per_node = launch.ranks_per_node or launch.num_ranks // launch.num_nodes
        tp, cp = launch.tensor_parallel_size, launch.context_parallel_size
        dp = launch.data_parallel_size or launch.num_ranks // (tp * cp)
        return cls(
            num_nodes=launch.num_nodes,
            ranks_per_node=ranks_per_node,
            data_parallel_size=dp,
            context_parallel_size=cp,
            tensor_parallel_size=tp,
            inference_replicas=launch.inference_replicas,
            inference_tensor_parallel_size=launch.inference_tensor_parallel_size,
            parallelism=parallelism,
        )

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def mesh_shape(self) -> tuple[int, int, int]:
        """Axis sizes, outermost first: ``(dp, cp, tp)``."""
        return (self.data_parallel_size, self.context_parallel_size, self.tensor_parallel_size)

    def mesh_axis_names(self) -> tuple[str, str, str]:
        """Axis names matching :meth:`mesh_shape`: ``('dp_replicate' | 'dp_shard', 'cp', 'tp')``."""
        return ("dp_shard" if self.parallelism == "fsdp2" else "dp_replicate", "cp", "tp")

    def node_of(self, rank: int) -> int:
        """The node (Slurm ``SLURM_NODEID``, accelerate ``--machine_rank``) that global ``rank`` runs on."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        return rank // self.ranks_per_node

    def inference_nodes(self, gpus_per_node: int) -> int:
        """Nodes the inference replicas need beside the train nodes (0 on CPU, where they share the controller's)."""
        if gpus_per_node <= 0:
            return 0
        gpus = self.inference_replicas * self.inference_tensor_parallel_size
        return -(-gpus // gpus_per_node)


def build_device_mesh(topology: Topology, device_type: str) -> DeviceMesh:
    """The device mesh of :meth:`Topology.mesh_shape` on the already-initialised default process group.

    Called on every rank (collective: all ranks, same order). ``device_type`` is 'cpu' (gloo) or 'cuda'.
    Raises ValueError when the process group's world size is not the topology's.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world != topology.world_size:
        raise ValueError(
            f"process group has {world} ranks, the topology declares num_nodes x ranks_per_node = "
            f"{topology.num_nodes} x {topology.ranks_per_node} = {topology.world_size}"
        )
    return init_device_mesh(device_type, topology.mesh_shape(), mesh_dim_names=topology.mesh_axis_names())
