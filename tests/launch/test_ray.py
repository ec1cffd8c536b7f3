"""The Ray launcher: placement bundles (pure functions); a Session on a local Ray instance when ray is installed."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import time
from typing import Any

import psutil
import pytest

from rlsdk import Session, SessionConfig
from rlsdk.config import LaunchConfig, RayConfig
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


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_dead(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _start_local_ray(ray: Any) -> Any:
    """``ray.init`` of a new local instance; once more if Ray's fixed 30 s wait for its raylet runs out (seen on
    2 cores shared with other test processes), since that is Ray's start-up, not the code under test."""
    for attempt in (1, 2):
        try:
            return ray.init(
                address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False
            )
        except Exception as exc:
            ray.shutdown()
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
    raise AssertionError("unreachable")


@pytest.mark.distributed
@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="ray extra not installed (pip install 'rlsdk[ray]'; `make test` installs it)",
)
def test_ray_session_on_two_simulated_nodes_of_a_local_ray_instance_trains_one_step_and_leaves_nothing_behind(
    small_config: SessionConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # A local instance started by this process stands in for the existing cluster; the Session connects to it by
    # its GCS address, as it would to a cluster's head (launch.ray.address). address='local': a new instance even
    # where another Ray runs on this machine. (`ray start --head` in a subprocess mirrors a cluster more closely,
    # but Ray 2.60 then wants its auth token in the driver, and only `ray stop`, which ends every Ray process of
    # the machine, shuts it down cleanly.)
    # Only the processes ray.init starts: other children of the test run (a session-scoped vLLM server) stay.
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    context = _start_local_ray(ray)
    ray_processes = [child.pid for child in psutil.Process().children(recursive=True) if child.pid not in before]
    launch = dataclasses.replace(
        small_config.launch,
        scheduler="ray",
        num_nodes=2,
        num_ranks=2,
        simulate_nodes_on_loopback=True,
        ray=RayConfig(address=context.address_info["gcs_address"]),
    )
    config = dataclasses.replace(small_config, launch=launch)

    async def scenario() -> dict[str, Any]:
        session = await Session.start(config)
        try:
            out: dict[str, Any] = {"rank_pids": [info["pid"] for info in session.rank_info.values()]}
            launcher = session._run.launcher
            out["placed"] = [
                pid
                for actor_pid in launcher.actor_pids
                for pid in [actor_pid, *(c.pid for c in psutil.Process(actor_pid).children(recursive=True))]
            ]
            out["lines"] = list(launcher.last_lines)
            rollout = await session.rollout()
            rollout = await session.reward(rollout, reverse_reward)
            out["stats"] = await session.update(rollout)
            info = await session.sync_weights()
            out["synced"] = (info.version, info.checksum == session.versions.trainer_checksum)
            out["versions"] = (session.versions.trainer_version, session.versions.engine_version)
            out["ranks"] = await session.call("noop")
            out["group"] = launcher.placement_group.id.hex()
        finally:
            await session.close()
        out["connected_after_close"] = ray.is_initialized()
        out["group_state"] = ray.util.placement_group_table().get(out["group"], {}).get("state")
        return out

    try:
        out = asyncio.run(scenario())
    finally:
        ray.shutdown()

    assert out["versions"] == (1, 1)
    assert out["synced"] == (1, True)
    assert out["ranks"] == [{"rank": 0}, {"rank": 1}]
    assert out["stats"]["version/trainer"] == 1.0
    assert any("2 node launchers (PACK)" in line for line in out["lines"])
    assert set(out["rank_pids"]) <= set(out["placed"])  # the ranks run under the Ray-placed node launchers
    assert out["connected_after_close"]  # the test connected this process, so the launcher left it connected
    assert out["group_state"] == "REMOVED"
    assert _wait_dead(out["placed"]) == []
    assert _wait_dead(ray_processes) == []
