"""SIGKILL of the controller (a dying kernel) must take every rank with it; a new Session then resumes the run."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from rlsdk import Session
from rlsdk.config import SessionConfig, config_to_dict
from rlsdk.rewards import reverse_reward

pytestmark = pytest.mark.distributed

CONTROLLER = textwrap.dedent(
    """
    import asyncio, json, sys
    from rlsdk import Session
    from rlsdk.config import SessionConfig, config_from_dict
    from rlsdk.rewards import reverse_reward

    async def main():
        config = config_from_dict(SessionConfig, json.loads(sys.argv[1]))
        session = await Session.start(config)
        await session.update(await session.reward(await session.rollout(), reverse_reward))
        await session.sync_weights()
        await session.save_checkpoint()
        pids = [info["pid"] for info in session.rank_info.values()]
        run = session._run
        print(json.dumps({"ranks": pids, "launcher": run.launcher.proc.pid, "publish_dir": run.publish_dir}),
              flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigkill_of_controller_leaves_no_rank_alive_after_10_seconds_and_a_new_session_resumes(
    small_config: SessionConfig, tmp_path: Path
) -> None:
    controller = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, json.dumps(config_to_dict(small_config))],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = controller.stdout.readline()
        assert line, "controller exited before its session started"
        pids = json.loads(line)
        children = pids["ranks"] + [pids["launcher"]]
        assert all(_alive(pid) for pid in children)
        publish_dir = Path(pids["publish_dir"])
        assert (publish_dir / "v1.safetensors").is_file()

        killed = time.monotonic()
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait(timeout=10)
        first_exit = None
        while time.monotonic() - killed < 10.0 and any(_alive(pid) for pid in children):
            if first_exit is None and not all(_alive(pid) for pid in children):
                first_exit = time.monotonic() - killed
            time.sleep(0.05)

        survivors = [pid for pid in children if _alive(pid)]
        assert survivors == [], f"processes outlived the controller: {survivors}"
        assert first_exit is None or first_exit < 5.0, f"the ranks noticed the dead controller after {first_exit} s"
    finally:
        if controller.poll() is None:
            controller.kill()
        for pid in locals().get("children", []):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

    resumed = dataclasses.replace(small_config, train=dataclasses.replace(small_config.train, resume_from="latest"))

    assert publish_dir.is_dir()  # the killed controller could not remove its published weights

    async def restart() -> tuple[str, int, int]:
        async with await Session.start(resumed) as session:  # sweeps the dead session's weights directory
            start_version = session.versions.trainer_version
            await session.update(await session.reward(await session.rollout(), reverse_reward))
            return session.resumed_from.name, start_version, session.versions.trainer_version

    name, start_version, version = asyncio.run(restart())

    assert (name, start_version, version) == ("step_1", 1, 2)
    assert not publish_dir.exists()
