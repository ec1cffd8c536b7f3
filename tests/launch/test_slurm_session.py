"""The Slurm launcher end to end on a fake Slurm: 2 simulated nodes x 1 rank form one real gloo group."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
from pathlib import Path

import psutil
import pytest

from rlsdk import Session, SessionConfig
from rlsdk.rewards import reverse_reward
from rlsdk.testing.fake_slurm import install_fake_slurm

pytestmark = pytest.mark.distributed


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_slurm_session_on_two_simulated_nodes_trains_one_step_and_verifies_the_weight_sync(
    small_config: SessionConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = install_fake_slurm(tmp_path / "fake-slurm-bin")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    launch = dataclasses.replace(
        small_config.launch, scheduler="slurm", num_nodes=2, num_ranks=2, simulate_nodes_on_loopback=True
    )
    config = dataclasses.replace(small_config, launch=launch)

    async def scenario() -> dict:
        session = await Session.start(config)
        try:
            out: dict = {"pids": [info["pid"] for info in session.rank_info.values()]}
            out["job_id"] = session._run.launcher.job_id
            rollout = await session.rollout()
            rollout = await session.reward(rollout, reverse_reward)
            out["stats"] = await session.update(rollout)
            info = await session.sync_weights()
            out["synced"] = (info.version, info.checksum == session.versions.trainer_checksum)
            out["versions"] = (session.versions.trainer_version, session.versions.engine_version)
            out["ranks"] = await session.call("noop")
        finally:
            await session.close()
        return out

    out = asyncio.run(scenario())

    assert out["job_id"] == "1000"
    assert out["versions"] == (1, 1)
    assert out["synced"] == (1, True)
    assert out["ranks"] == [{"rank": 0}, {"rank": 1}]
    assert out["stats"]["version/trainer"] == 1.0
    job_dir = Path(config.observe.output_dir) / "launch" / "slurm"
    script = (job_dir / "train.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and '--machine_rank "$SLURM_NODEID"' in script
    output = (job_dir / "slurm-1000.out").read_text()
    assert "rlsdk: job 1000 on 127.0.0.1,127.0.0.1" in output
    assert not [pid for pid in out["pids"] if _alive(pid)]


def test_slurm_session_whose_job_fails_before_the_ranks_connect_raises_with_the_jobs_last_lines(
    small_config: SessionConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = install_fake_slurm(tmp_path / "fake-slurm-bin")
    (bin_dir / "srun").write_text("#!/bin/sh\necho 'srun: error: Unable to create step for job'\nexit 1\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    launch = dataclasses.replace(
        small_config.launch,
        scheduler="slurm",
        num_nodes=2,
        num_ranks=2,
        simulate_nodes_on_loopback=True,
        start_timeout_s=30.0,
    )
    config = dataclasses.replace(small_config, launch=launch)

    with pytest.raises(Exception, match="Unable to create step") as info:
        asyncio.run(Session.start(config))

    assert "exit code 1" in str(info.value)


@pytest.mark.multinode
def test_slurm_session_on_a_real_cluster_trains_one_step_and_verifies_the_sync(small_config: SessionConfig) -> None:
    host = os.environ.get("RLSDK_TEST_SLURM_HOST")
    if host is None or not shutil.which("sbatch"):
        pytest.skip(
            "multinode: needs a real Slurm cluster (run on a login node with sbatch, a filesystem shared with the "
            "compute nodes, and RLSDK_TEST_SLURM_HOST = this node's address reachable from them)"
        )
    launch = dataclasses.replace(
        small_config.launch, scheduler="slurm", num_nodes=2, num_ranks=2, host=host, allow_remote=True
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

    assert asyncio.run(scenario()) == (1, 1)
