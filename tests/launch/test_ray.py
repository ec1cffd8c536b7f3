"""The Ray launcher: placement bundles (pure functions); a Session on a local Ray instance when ray is installed."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util

import pytest

from rlsdk import Session, SessionConfig
from rlsdk.config import LaunchConfig
from rlsdk.launch.ray import inference_bundles, train_bundles
from rlsdk.rewards import reverse_reward


def test_train_bundles_on_sixteen_gpu_nodes_spread_one_bundle_per_node() -> None:
    launch = LaunchConfig(
        scheduler="ray", num_nodes=16, num_ranks=64, gpus_per_node=4, host="10.0.0.5", allow_remote=True
    )

    bundles, strategy = train_bundles(launch)

    assert strategy == "STRICT_SPREAD"
    assert bundles == [{"CPU": 4.0, "GPU": 4.0}] * 16


def test_train_bundles_when_simulating_nodes_on_loopback_pack_onto_this_machine() -> None:
    launch = LaunchConfig(scheduler="ray", num_nodes=2, num_ranks=2, simulate_nodes_on_loopback=True)

    bundles, strategy = train_bundles(launch)

    assert (bundles, strategy) == ([{"CPU": 1.0}, {"CPU": 1.0}], "PACK")


def test_inference_bundles_keep_each_replicas_tensor_parallel_gpus_on_one_node() -> None:
    launch = LaunchConfig(inference_replicas=2, inference_tensor_parallel_size=4, gpus_per_node=8)

    groups = inference_bundles(launch)

    assert groups == [([{"GPU": 1.0, "CPU": 1.0}] * 4, "STRICT_PACK")] * 2


@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray extra not installed")
def test_ray_session_on_a_local_ray_instance_trains_one_step_and_verifies_the_sync(
    small_config: SessionConfig,
) -> None:
    import ray

    ray.init(num_cpus=4, include_dashboard=False)
    launch = dataclasses.replace(
        small_config.launch, scheduler="ray", num_nodes=2, num_ranks=2, simulate_nodes_on_loopback=True
    )
    config = dataclasses.replace(small_config, launch=launch)

    async def scenario() -> tuple[int, int]:
        session = await Session.start(config)
        try:
            rollout = await session.reward(await session.rollout(), reverse_reward)
            await session.update(rollout)
            await session.sync_weights()
            return session.versions.trainer_version, session.versions.engine_version
        finally:
            await session.close()

    try:
        versions = asyncio.run(scenario())
    finally:
        ray.shutdown()

    assert versions == (1, 1)
