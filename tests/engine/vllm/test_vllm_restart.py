"""A vLLM server that dies is reported with its exit code and last log lines, and the Session restarts it.

Runs after test_vllm_engine.py (file order); it restarts the suite's server, so the Session stays usable.
"""

from __future__ import annotations

import asyncio
import os
import signal
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
