"""The device plan (rlsdk/config/device.py): CPU exactly as before, and simulated CUDA topologies of 1, 2 and 8 GPUs
with and without a vLLM server on this machine, asserted per rank."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rlsdk.config import ConfigError, InferenceConfig, LaunchConfig, SessionConfig
from rlsdk.config.device import (
    DEVICE_ENV,
    GLOO,
    NCCL,
    NCCL_TRACE_BUFFER_SIZE,
    SHARED_GPU_MEMORY_UTILIZATION,
    DevicePlan,
    plan_devices,
    rank_device,
    visible_cuda_devices,
)
from rlsdk.launch.local import accelerate_command

CUDA_GROUP = f"cpu:{GLOO},cuda:{NCCL}"


def _ranks(plan: DevicePlan, num_ranks: int) -> list[dict[str, object]]:
    """What each local rank gets: its Accelerator arguments, its torch device and its process-group backend."""
    return [
        {"accelerator": plan.accelerator_kwargs(), "device": plan.local_device(r), "pg": plan.process_group_backend}
        for r in range(num_ranks)
    ]


def _cuda_ranks(num_ranks: int) -> list[dict[str, object]]:
    return [{"accelerator": {}, "device": f"cuda:{r}", "pg": CUDA_GROUP} for r in range(num_ranks)]


def _gpus(n: int) -> tuple[str, ...]:
    return tuple(str(i) for i in range(n))


def test_plan_on_a_machine_without_gpus_is_cpu_gloo_with_a_cpu_accelerator_as_before() -> None:
    launch = LaunchConfig(num_ranks=2)

    plan = plan_devices(launch, local_server_gpus=1, visible_gpus=())

    assert (plan.device, plan.backend, plan.process_group_backend) == ("cpu", GLOO, GLOO)
    assert _ranks(plan, 2) == [{"accelerator": {"cpu": True}, "device": "cpu", "pg": GLOO}] * 2
    assert plan.rank_environment(tracer=True) == {DEVICE_ENV: "cpu"}  # no CUDA_VISIBLE_DEVICES, no NCCL buffer
    assert plan.server_environment() == {} and plan.server_args() == []
    assert plan.accelerate_launch_args(1) == ["--cpu", "--mixed_precision", "no"]
    assert plan.accelerate_launch_args(2) == ["--multi_gpu", "--mixed_precision", "no"]


def test_plan_with_device_cpu_on_a_gpu_machine_stays_on_cpu() -> None:
    plan = plan_devices(LaunchConfig(num_ranks=2, device="cpu"), visible_gpus=_gpus(8))

    assert plan.device == "cpu" and plan.rank_gpus == ()


def test_plan_on_one_gpu_with_vllm_shares_the_card_with_a_capped_memory_fraction_and_sleep_mode() -> None:
    launch = LaunchConfig(num_ranks=1)

    plan = plan_devices(launch, mixed_precision="bf16", local_server_gpus=1, visible_gpus=_gpus(1))

    assert (plan.device, plan.backend, plan.mixed_precision) == ("cuda", NCCL, "bf16")
    assert _ranks(plan, 1) == _cuda_ranks(1)
    assert plan.rank_environment(tracer=True) == {
        DEVICE_ENV: "cuda",
        "CUDA_VISIBLE_DEVICES": "0",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(NCCL_TRACE_BUFFER_SIZE),
    }
    assert plan.shares_gpu and plan.server_environment() == {"CUDA_VISIBLE_DEVICES": "0"}
    assert plan.server_args() == ["--gpu-memory-utilization", str(SHARED_GPU_MEMORY_UTILIZATION), "--enable-sleep-mode"]
    # One CUDA rank: accelerate's plain launcher, without --cpu (which would put the rank on the CPU).
    assert plan.accelerate_launch_args(1) == ["--mixed_precision", "no"]


def test_plan_on_one_gpu_without_a_server_gives_the_rank_the_card_alone() -> None:
    plan = plan_devices(LaunchConfig(num_ranks=1), local_server_gpus=0, visible_gpus=_gpus(1))

    assert plan.rank_gpus == ("0",) and plan.server_gpus == () and not plan.shares_gpu
    assert plan.rank_environment(tracer=False) == {DEVICE_ENV: "cuda", "CUDA_VISIBLE_DEVICES": "0"}


def test_plan_on_two_gpus_puts_one_rank_and_vllm_on_a_gpu_each() -> None:
    plan = plan_devices(LaunchConfig(num_ranks=1), local_server_gpus=1, visible_gpus=_gpus(2))

    assert plan.rank_gpus == ("0",) and plan.server_gpus == ("1",) and not plan.shares_gpu
    assert plan.server_environment() == {"CUDA_VISIBLE_DEVICES": "1"} and plan.server_args() == []


def test_plan_on_two_gpus_without_a_server_runs_two_nccl_ranks() -> None:
    plan = plan_devices(LaunchConfig(num_ranks=2), visible_gpus=_gpus(2))

    assert _ranks(plan, 2) == _cuda_ranks(2)
    assert plan.rank_environment(tracer=False)["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert plan.accelerate_launch_args(2) == ["--multi_gpu", "--mixed_precision", "no"]


def test_plan_on_two_gpus_with_two_ranks_and_vllm_raises_naming_num_ranks() -> None:
    with pytest.raises(ConfigError, match=r"launch\.num_ranks=2.*at most 1 with a vLLM server of 1 GPU"):
        plan_devices(LaunchConfig(num_ranks=2), local_server_gpus=1, visible_gpus=_gpus(2))


@pytest.mark.parametrize(
    ("num_ranks", "server_gpus", "ranks_visible", "server_visible"),
    [
        (8, 0, "0,1,2,3,4,5,6,7", ""),
        (7, 1, "0,1,2,3,4,5,6", "7"),  # TRL's server mode: 7 trainers, vLLM on the eighth GPU
        (6, 2, "0,1,2,3,4,5", "6,7"),  # vLLM with tensor parallel size 2
        (4, 1, "0,1,2,3", "4"),
    ],
)
def test_plan_on_eight_gpus_gives_each_rank_one_gpu_and_vllm_the_next(
    num_ranks: int, server_gpus: int, ranks_visible: str, server_visible: str
) -> None:
    plan = plan_devices(LaunchConfig(num_ranks=num_ranks), local_server_gpus=server_gpus, visible_gpus=_gpus(8))

    assert _ranks(plan, num_ranks) == _cuda_ranks(num_ranks)
    assert plan.rank_environment(tracer=False)["CUDA_VISIBLE_DEVICES"] == ranks_visible
    assert ",".join(plan.server_gpus) == server_visible and not plan.shares_gpu


def test_plan_on_eight_gpus_with_eight_ranks_and_vllm_raises_naming_num_ranks() -> None:
    with pytest.raises(ConfigError, match=r"launch\.num_ranks=8.*at most 7"):
        plan_devices(LaunchConfig(num_ranks=8), local_server_gpus=1, visible_gpus=_gpus(8))


def test_plan_with_more_ranks_than_gpus_raises_naming_num_ranks() -> None:
    with pytest.raises(ConfigError, match=r"launch\.num_ranks=4.*at most 2 on this machine's 2 GPU"):
        plan_devices(LaunchConfig(num_ranks=4), visible_gpus=_gpus(2))


def test_plan_keeps_the_users_cuda_visible_devices_ids() -> None:
    plan = plan_devices(LaunchConfig(num_ranks=1), local_server_gpus=1, visible_gpus=("4", "5"))

    assert plan.rank_gpus == ("4",) and plan.server_gpus == ("5",)


def test_plan_with_device_cuda_on_a_machine_without_cuda_raises_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"launch\.device='cuda'.*torch\.cuda\.is_available\(\) is False"):
        plan_devices(LaunchConfig(num_ranks=1, device="cuda"), visible_gpus=())


def _slurm(**fields: object) -> LaunchConfig:
    base = {"scheduler": "slurm", "host": "10.0.0.5", "allow_remote": True}
    return LaunchConfig(**{**base, **fields})  # type: ignore[arg-type]


def test_plan_on_slurm_with_gpus_per_node_is_cuda_and_leaves_cuda_visible_devices_to_slurm() -> None:
    launch = _slurm(num_nodes=2, num_ranks=16, gpus_per_node=8)

    plan = plan_devices(launch, visible_gpus=())  # the controller itself may have no GPU

    assert (plan.device, plan.backend, plan.ranks_per_node) == ("cuda", NCCL, 8)
    assert _ranks(plan, 8) == _cuda_ranks(8)
    assert "CUDA_VISIBLE_DEVICES" not in plan.rank_environment(tracer=False)


def test_plan_on_slurm_without_gpus_is_cpu() -> None:
    assert plan_devices(_slurm(num_nodes=2, num_ranks=4)).device == "cpu"


def test_plan_on_slurm_with_fewer_gpus_than_ranks_per_node_raises_naming_gpus_per_node() -> None:
    with pytest.raises(ConfigError, match=r"launch\.gpus_per_node=4.*at least the 8 train ranks per node"):
        plan_devices(_slurm(num_nodes=2, num_ranks=16, gpus_per_node=4))


def test_launch_config_with_device_cuda_on_slurm_without_gpus_raises_naming_device() -> None:
    with pytest.raises(ConfigError, match=r"LaunchConfig\.device='cuda'.*gpus_per_node"):
        _slurm(num_nodes=2, num_ranks=4, device="cuda")


def test_launch_config_with_backend_nccl_raises_saying_how_nccl_is_chosen() -> None:
    with pytest.raises(ConfigError, match=r"LaunchConfig\.backend='nccl'.*launch\.device='cuda'"):
        LaunchConfig(backend="nccl")  # type: ignore[arg-type]


def test_launch_config_device_defaults_to_auto_and_rejects_other_names() -> None:
    assert LaunchConfig().device == "auto"
    with pytest.raises(ConfigError, match=r"LaunchConfig\.device='gpu'.*'auto', 'cpu', 'cuda'"):
        LaunchConfig(device="gpu")  # type: ignore[arg-type]


def test_rank_device_reads_the_launchers_variable_and_defaults_to_cpu() -> None:
    assert rank_device({}) == "cpu"
    assert rank_device({DEVICE_ENV: "cuda"}) == "cuda"
    with pytest.raises(ValueError, match="RLSDK_DEVICE='tpu'"):
        rank_device({DEVICE_ENV: "tpu"})


def test_local_accelerate_command_takes_its_device_flags_from_the_plan() -> None:
    assert "--cpu" in accelerate_command(1)  # as before: one CPU rank
    assert "--cpu" not in accelerate_command(1, device="cuda")
    cuda_two = accelerate_command(2, device="cuda")
    assert "--multi_gpu" in cuda_two and "--cpu" not in cuda_two
    assert cuda_two[cuda_two.index("--mixed_precision") + 1] == "no"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's plan; this machine has CUDA")
def test_preflight_plan_with_device_auto_on_this_cpu_machine_is_cpu(tmp_path: Path, tiny_model_dir: Path) -> None:
    from rlsdk.config import ModelConfig, ObserveConfig
    from rlsdk.preflight import device_plan

    config = SessionConfig(
        model=ModelConfig(path=str(tiny_model_dir)),
        inference=InferenceConfig(engine="vllm"),
        observe=ObserveConfig(output_dir=str(tmp_path)),
    )

    assert visible_cuda_devices() == ()
    assert device_plan(config).device == "cpu"
    cuda = dataclasses.replace(config, launch=dataclasses.replace(config.launch, device="cuda"))
    with pytest.raises(ConfigError, match=r"launch\.device"):
        device_plan(cuda)
