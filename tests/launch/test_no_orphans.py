"""SIGKILL of the controller (a dying kernel) must take every rank with it."""

from __future__ import annotations

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

from rlsdk.config import SessionConfig, config_to_dict

pytestmark = pytest.mark.distributed

CONTROLLER = textwrap.dedent(
    """
    import asyncio, json, sys
    from rlsdk import Session
    from rlsdk.config import SessionConfig, config_from_dict

    async def main():
        config = config_from_dict(SessionConfig, json.loads(sys.argv[1]))
        session = await Session.start(config)
        pids = [info["pid"] for info in session.rank_info.values()]
        print(json.dumps({"ranks": pids, "launcher": session._launcher.proc.pid}), flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigkill_of_controller_leaves_no_rank_alive_after_10_seconds(
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

        os.kill(controller.pid, signal.SIGKILL)
        controller.wait(timeout=10)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(_alive(pid) for pid in children):
            time.sleep(0.2)

        survivors = [pid for pid in children if _alive(pid)]
        assert survivors == [], f"processes outlived the controller: {survivors}"
    finally:
        if controller.poll() is None:
            controller.kill()
        for pid in locals().get("children", []):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
