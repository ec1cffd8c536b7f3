"""A vLLM server that dies is reported with its exit code and last log lines, and the Session restarts it.

Runs after test_vllm_engine.py (file order); it restarts the suite's server, so the Session stays usable.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import psutil
import pytest

from rlsdk.engine.inference.vllm_server import InferenceServerError

# The suite's LoopSession (see conftest.py): ``.session`` and ``.run(coro)`` on the Session's own event loop.
LoopSession = Any


def test_vllm_killed_server_is_reported_with_exit_code_and_last_lines_and_restart_serves_trainer_version(
    vllm_session: LoopSession,
) -> None:
    session = vllm_session.session
    server = session.engine.server
    old_group = server.pid
    shm_files = set(server.shm.paths)  # the engine core's message queues, recorded when the server got healthy

    async def kill_and_use() -> InferenceServerError:
        os.kill(server.pid, signal.SIGKILL)
        await asyncio.wait_for(server.wait(), timeout=30)
        await asyncio.sleep(0.2)  # let the Session's watcher record the exit
        with pytest.raises(InferenceServerError) as info:
            await session.rollout()
        return info.value

    error = vllm_session.run(kill_and_use())

    assert error.returncode == -signal.SIGKILL
    assert "SIGKILL" in str(error) and "Last log lines" in str(error)
    assert error.last_lines
    assert shm_files, "the server mapped no /dev/shm file: nothing was recorded to clean up"
    assert not [path for path in shm_files if os.path.exists(path)]  # removed although SIGKILL left them
    info = vllm_session.run(session.restart_engine())
    assert info.version == session.versions.trainer_version
    assert info.checksum == session.versions.trainer_checksum
    assert session.engine.server.pid != old_group
    rollout = vllm_session.run(session.rollout())
    assert rollout.versions == [session.versions.trainer_version]
    assert not [p for p in psutil.process_iter(["pid"]) if _pgid(p.info["pid"]) == old_group]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def test_vllm_server_killed_mid_rollout_is_reported_within_5s_and_session_restart_resumes_from_the_checkpoint(
    vllm_session: LoopSession,
) -> None:
    session = vllm_session.session

    async def scenario() -> dict[str, Any]:
        out: dict[str, Any] = {"checkpoint": await session.save_checkpoint()}
        server = session.engine.server
        out["old_group"] = server.pid
        loop = asyncio.get_running_loop()
        killed: list[float] = []
        loop.call_later(0.3, lambda: (os.kill(server.pid, signal.SIGKILL), killed.append(time.monotonic())))
        with pytest.raises(InferenceServerError) as info:
            for _ in range(1000):  # back-to-back rollouts: the kill lands while requests are in flight
                await session.rollout()
        out["detect_s"] = time.monotonic() - killed[0]
        out["error"] = info.value
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and _group_alive(out["old_group"]):
            await asyncio.sleep(0.1)
        out["group_alive"] = _group_alive(out["old_group"])
        out["resumed_from"] = await session.restart()
        out["version"] = session.versions.trainer_version
        out["rollout_versions"] = (await session.rollout()).versions
        return out

    out = vllm_session.run(scenario())

    assert out["detect_s"] < 5.0
    assert "SIGKILL" in str(out["error"]) or "exit code" in str(out["error"])
    assert not out["group_alive"]
    assert out["resumed_from"] == out["checkpoint"]
    assert out["version"] == int(out["checkpoint"].name.removeprefix("step_"))
    assert out["rollout_versions"] == [out["version"]]


def _group_alive(pgid: int) -> bool:
    return any(_pgid(p.info["pid"]) == pgid for p in psutil.process_iter(["pid"]))
