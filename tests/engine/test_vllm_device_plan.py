"""The vLLM engine starts its server where the device plan says (rlsdk/config/device.py): its GPUs in
``CUDA_VISIBLE_DEVICES`` and, sharing the one GPU with a train rank, a memory cap and sleep mode. Checked on the
arguments the engine passes to its server (no server starts here: the GPU run is tests/gpu/test_gpu.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from rlsdk.config import InferenceConfig, LaunchConfig, SessionConfig, VLLMConfig
from rlsdk.config.device import SHARED_GPU_MEMORY_UTILIZATION, plan_devices
from rlsdk.engine.inference.protocol import EngineContext
from rlsdk.engine.inference.vllm import VLLMEngine


class _Ranks:
    commands_sent = 0

    async def broadcast(self, command: str, body: Any = None, *, timeout_s: float | None) -> list[Any]:
        raise AssertionError("no rank command is expected while the engine is built")


def _start_kwargs(monkeypatch: pytest.MonkeyPatch, config: SessionConfig, plan: Any) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    async def fake_start(cls: type, model_path: str, **kwargs: Any) -> str:
        seen.update(kwargs)
        return "engine"

    monkeypatch.setattr(VLLMEngine, "start", classmethod(fake_start))
    context = EngineContext(config=config, special_tokens=None, trainer=_Ranks(), device_plan=plan)
    assert asyncio.run(VLLMEngine.build(context)) == "engine"
    return seen


def _config(small_config: SessionConfig, num_ranks: int) -> SessionConfig:
    return dataclasses.replace(
        small_config,
        launch=dataclasses.replace(small_config.launch, num_ranks=num_ranks),
        inference=InferenceConfig(engine="vllm", vllm=VLLMConfig(extra_server_args=("--seed", "1"))),
    )


def test_vllm_server_sharing_the_one_gpu_gets_it_with_a_memory_cap_and_sleep_mode(
    monkeypatch: pytest.MonkeyPatch, small_config: SessionConfig
) -> None:
    config = _config(small_config, 1)
    plan = plan_devices(LaunchConfig(num_ranks=1), local_server_gpus=1, visible_gpus=("0",))

    kwargs = _start_kwargs(monkeypatch, config, plan)

    assert kwargs["server_env"] == {"CUDA_VISIBLE_DEVICES": "0"}
    assert kwargs["extra_server_args"] == [
        "--gpu-memory-utilization",
        str(SHARED_GPU_MEMORY_UTILIZATION),
        "--enable-sleep-mode",
        "--seed",  # the user's own arguments come last, so they can override the plan's
        "1",
    ]
    # NCCL cannot put the rank and the server's worker on one GPU: the weights go by CUDA IPC, whose worker
    # extension the server is started with
    assert kwargs["transfer"].name == "ipc"


def test_vllm_server_beside_seven_ranks_gets_the_eighth_gpu_alone(
    monkeypatch: pytest.MonkeyPatch, small_config: SessionConfig
) -> None:
    config = _config(small_config, 7)
    plan = plan_devices(LaunchConfig(num_ranks=7), local_server_gpus=1, visible_gpus=tuple("01234567"))

    kwargs = _start_kwargs(monkeypatch, config, plan)

    assert kwargs["server_env"] == {"CUDA_VISIBLE_DEVICES": "7"}
    assert kwargs["extra_server_args"] == ["--seed", "1"]


def test_vllm_server_of_a_cpu_plan_gets_no_gpu_and_the_users_arguments_only(
    monkeypatch: pytest.MonkeyPatch, small_config: SessionConfig
) -> None:
    config = _config(small_config, 2)

    kwargs = _start_kwargs(monkeypatch, config, plan_devices(config.launch, local_server_gpus=1))

    assert kwargs["server_env"] == {} and kwargs["extra_server_args"] == ["--seed", "1"]
