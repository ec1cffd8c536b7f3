"""Topology in LaunchConfig: impossible layouts fail at construction; the device mesh matches the declared axes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rlsdk.config import ConfigError, LaunchConfig
from rlsdk.launch.select import check_runnable
from rlsdk.launch.topology import Topology, build_device_mesh


def test_default_launch_config_is_one_local_node_with_a_pure_data_parallel_mesh() -> None:
    launch = LaunchConfig(num_ranks=4)

    topology = Topology.from_config(launch)

    assert (launch.scheduler, launch.num_nodes) == ("local", 1)
    assert topology.ranks_per_node == 4
    assert topology.mesh_shape() == (4, 1, 1)
    assert topology.mesh_axis_names() == ("dp_replicate", "cp", "tp")


@pytest.mark.parametrize(
    ("kwargs", "field", "arithmetic"),
    [
        ({"num_ranks": 3, "num_nodes": 2, "scheduler": "slurm"}, "num_nodes", "3 / 2 is not a whole number"),
        (
            {"num_ranks": 4, "num_nodes": 2, "ranks_per_node": 3, "scheduler": "slurm"},
            "ranks_per_node",
            "2 x 3 = 6, but num_ranks = 4",
        ),
        ({"num_ranks": 4, "data_parallel_size": 3}, "data_parallel_size", "3 x 1 x 1 = 3, but num_ranks = 4"),
        ({"num_ranks": 4, "tensor_parallel_size": 3}, "tensor_parallel_size", "= 3 does not divide num_ranks = 4"),
        ({"num_ranks": 2, "num_nodes": 2}, "num_nodes", "scheduler='local'"),
        ({"num_ranks": 2, "num_nodes": 2, "scheduler": "slurm"}, "host", "simulate_nodes_on_loopback"),
        ({"num_ranks": 2, "scheduler": "ray"}, "host", "scheduler='ray' (its ranks run on other machines)"),
        ({"gpus_per_node": 4, "inference_tensor_parallel_size": 8}, "inference_tensor_parallel_size", "= 4"),
        ({"main_process_port": 70000}, "main_process_port", "[1, 65535]"),
    ],
)
def test_impossible_topology_fails_at_construction_naming_the_field_and_the_arithmetic(
    kwargs: dict, field: str, arithmetic: str
) -> None:
    with pytest.raises(ConfigError) as info:
        LaunchConfig(**kwargs)

    message = str(info.value)
    assert f"LaunchConfig.{field}=" in message
    assert arithmetic in message


def test_mixed_parallel_sizes_with_the_wrong_product_spell_out_dp_times_cp_times_tp() -> None:
    with pytest.raises(ConfigError, match=r"2 x 3 x 2 = 12, but num_ranks = 8"):
        LaunchConfig(num_ranks=8, data_parallel_size=2, context_parallel_size=3, tensor_parallel_size=2)


def test_sixteen_node_topology_derives_ranks_per_node_and_data_parallel_size() -> None:
    launch = LaunchConfig(
        scheduler="slurm", num_nodes=16, num_ranks=64, tensor_parallel_size=4, host="10.0.0.5", allow_remote=True
    )

    topology = Topology.from_config(launch, parallelism="fsdp2")

    assert topology.ranks_per_node == 4
    assert topology.mesh_shape() == (16, 1, 4)
    assert topology.mesh_axis_names() == ("dp_shard", "cp", "tp")
    assert [topology.node_of(rank) for rank in (0, 3, 4, 63)] == [0, 0, 1, 15]


def test_inference_nodes_round_up_replica_gpus_to_whole_nodes() -> None:
    topology = Topology(1, 8, 8, 1, 1, inference_replicas=3, inference_tensor_parallel_size=4)

    assert topology.inference_nodes(gpus_per_node=8) == 2
    assert topology.inference_nodes(gpus_per_node=0) == 0


def test_tensor_parallel_topology_is_accepted_by_config_but_refused_at_start_until_the_engine_supports_it() -> None:
    launch = LaunchConfig(num_ranks=4, tensor_parallel_size=2)

    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2.*data parallel only"):
        check_runnable(launch)


@pytest.fixture()
def fake_world() -> Iterator[int]:
    """A fake process group of 8 ranks (no communication): this process plays rank 5."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        yield 5
    finally:
        dist.destroy_process_group()


def test_device_mesh_on_a_fake_process_group_has_the_declared_axes_and_this_ranks_groups(fake_world: int) -> None:
    topology = Topology(
        num_nodes=2, ranks_per_node=4, data_parallel_size=2, context_parallel_size=2, tensor_parallel_size=2,
        parallelism="fsdp2",
    )  # fmt: skip

    mesh = build_device_mesh(topology, "cpu")

    assert mesh.mesh_dim_names == ("dp_shard", "cp", "tp")
    assert tuple(mesh.shape) == (2, 2, 2)
    assert list(mesh.get_coordinate()) == [1, 0, 1]  # rank 5 = 1*4 + 0*2 + 1
    assert mesh["tp"].mesh.tolist() == [4, 5]  # a tensor-parallel group: consecutive ranks, one node
    assert mesh["dp_shard"].mesh.tolist() == [1, 5]


def test_device_mesh_refuses_a_process_group_of_another_size(fake_world: int) -> None:
    topology = Topology(num_nodes=1, ranks_per_node=4, data_parallel_size=4, context_parallel_size=1,
                        tensor_parallel_size=1)  # fmt: skip

    with pytest.raises(ValueError, match=r"8 ranks.*1 x 4 = 4"):
        build_device_mesh(topology, "cpu")


def test_topology_with_axes_that_do_not_multiply_to_the_world_raises_with_the_arithmetic() -> None:
    with pytest.raises(ValueError, match=r"2 x 1 x 1 = 2 != world size num_nodes x ranks_per_node = 2 x 2 = 4"):
        Topology(num_nodes=2, ranks_per_node=2, data_parallel_size=2, context_parallel_size=1, tensor_parallel_size=1)
