"""Fault injection on a real Session: each fault is detected within 5 s, leaves no process of the run alive within
10 s, and ``session.restart()`` then continues the run from the last checkpoint exactly.

The inference-server case lives with the vLLM suite (tests/engine/vllm/test_vllm_restart.py); the kernel-death
case in tests/launch/test_no_orphans.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psutil
import pytest

from rlsdk import RankError, Session, SessionClosedError, SessionConfig
from rlsdk.control.errors import RankUnresponsiveError
from rlsdk.launch.supervised import RankProcessError
from rlsdk.rewards import reverse_reward

pytestmark = pytest.mark.distributed

DETECT_S = 5.0
CLEAN_S = 10.0


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _run_pids(session: Session) -> list[int]:
    """Every process of the run: the ranks, the launcher and everything started under it (not other children of
    the test process, such as a session-scoped vLLM server of another suite)."""
    launcher = session._run.launcher.proc.pid
    pids = [info["pid"] for info in session.rank_info.values()] + [launcher]
    with contextlib.suppress(psutil.NoSuchProcess):
        pids += [child.pid for child in psutil.Process(launcher).children(recursive=True) if child.pid not in pids]
    return pids


async def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        await asyncio.sleep(0.05)
    return [pid for pid in pids if _alive(pid)]


async def _step(session: Session) -> float:
    rollout = await session.reward(await session.rollout(), reverse_reward)
    stats = await session.update(rollout)
    await session.sync_weights()
    return float(stats["train/loss"])


async def _fault_then_restart(
    config: SessionConfig, inject: Callable[[Session], Awaitable[Any]], drive: Callable[[Session], Awaitable[Any]]
) -> dict[str, Any]:
    """Run 2 steps (checkpoint after the first), inject the fault, keep ``drive``-ing the session until it fails;
    then restart and replay step 2. Returns timings, the error, survivors and both step-2 losses."""
    out: dict[str, Any] = {}
    session = await Session.start(config)
    try:
        await _step(session)
        await session.save_checkpoint()  # step_1
        out["loss_step2"] = await _step(session)
        pids = _run_pids(session)
        fault_time = time.monotonic()
        await inject(session)
        try:
            for _ in range(200):
                await drive(session)
        except BaseException as exc:  # the fault under test, whatever its type
            out["error"] = exc
        out["detect_s"] = time.monotonic() - fault_time
        out["survivors"] = await _gone_within(pids, CLEAN_S - (time.monotonic() - fault_time))
        out["failure"] = session.status()["failure"]
        with pytest.raises(SessionClosedError, match=r"session\.restart\(\)"):
            await session.rollout()
        out["resumed_from"] = await session.restart()
        out["version_after_restart"] = session.versions.trainer_version
        out["loss_step2_replayed"] = await _step(session)
        out["version_after_step"] = session.versions.trainer_version
    finally:
        for pid in _run_pids(session) if session.rank_info else []:
            if _alive(pid):
                os.kill(pid, signal.SIGCONT)
        await session.close()
    return out


def _assert_recovered(out: dict[str, Any]) -> None:
    assert out["detect_s"] < DETECT_S, f"fault detected after {out['detect_s']:.1f} s"
    assert out["survivors"] == [], f"processes of the run still alive {CLEAN_S} s after the fault"
    assert out["failure"]
    assert out["resumed_from"].name == "step_1"
    assert out["version_after_restart"] == 1
    assert out["version_after_step"] == 2
    # resume is exact: the replayed step 2 (same data, same seeds, same weights) gives the same loss
    assert out["loss_step2_replayed"] == pytest.approx(out["loss_step2"], rel=1e-5, abs=1e-7)


def test_rank_killed_mid_update_is_named_with_its_signal_and_restart_resumes_from_the_checkpoint(
    small_config: SessionConfig,
) -> None:
    async def kill_rank1_soon(session: Session) -> None:
        # as the next update command goes out: the rank dies inside it (a kill timed from the start of the step
        # could land during the rollout, and a fault between calls is reported as SessionClosedError instead)
        pid = session.rank_info[1]["pid"]
        broadcast = session._broadcast

        async def broadcast_then_kill(command: str, *args: Any, **kwargs: Any) -> Any:
            if command == "update":
                session._broadcast = broadcast  # type: ignore[method-assign]
                asyncio.get_running_loop().call_soon(os.kill, pid, signal.SIGKILL)
            return await broadcast(command, *args, **kwargs)

        session._broadcast = broadcast_then_kill  # type: ignore[method-assign]

    out = asyncio.run(_fault_then_restart(small_config, kill_rank1_soon, _step))

    error = out["error"]
    assert isinstance(error, RankProcessError), repr(error)
    assert error.failed_rank == 1 and error.rank_returncode == -signal.SIGKILL
    assert "train rank 1" in str(error) and "SIGKILL" in str(error)
    _assert_recovered(out)


def test_rank_raising_while_its_peer_waits_in_a_collective_stops_the_run_and_restart_resumes(
    small_config: SessionConfig,
) -> None:
    async def nothing(session: Session) -> None:
        return None

    async def raise_on_rank1(session: Session) -> None:
        await session.call("call_function", {"target": "rlsdk.testing.faults:raise_on_rank", "kwargs": {"rank": 1}})

    out = asyncio.run(_fault_then_restart(small_config, nothing, raise_on_rank1))

    error = out["error"]
    assert isinstance(error, RankError) and error.rank == 1 and error.exc_type == "InjectedFault"
    assert any("still inside 'call_function'" in note for note in error.__notes__)
    _assert_recovered(out)


def test_rank_that_stops_heartbeating_is_reported_within_the_heartbeat_timeout_and_restart_resumes(
    small_config: SessionConfig,
) -> None:
    config = dataclasses.replace(
        small_config,
        launch=dataclasses.replace(small_config.launch, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0),
    )

    async def stop_rank1(session: Session) -> None:
        os.kill(session.rank_info[1]["pid"], signal.SIGSTOP)

    async def poll(session: Session) -> None:
        await asyncio.sleep(0.05)
        session.next_prompts()  # raises SessionClosedError once the run failed

    out = asyncio.run(_fault_then_restart(config, stop_rank1, poll))

    error = out["error"]
    assert isinstance(error, SessionClosedError)
    assert "train rank 1" in str(error) and "no heartbeat" in str(error) and "heartbeat_timeout_s" in str(error)
    assert "no heartbeat" in out["failure"]
    _assert_recovered(out)


def test_rank_raising_on_every_rank_keeps_the_ranks_in_step_and_the_session_usable(
    small_config: SessionConfig,
) -> None:
    async def scenario() -> tuple[RankError, float, dict[str, Any]]:
        async with await Session.start(small_config) as session:
            with pytest.raises(RankError) as info:
                await session.call("call_function", {"target": "rlsdk.testing.faults:raise_on_every_rank"})
            loss = await _step(session)
            return info.value, loss, session.status()

    error, loss, status = asyncio.run(scenario())

    assert error.exc_type == "InjectedFault" and not getattr(error, "__notes__", [])
    assert loss == loss  # a finite step ran after the error
    assert status["failure"] is None and status["trainer_version"] == 1


def test_restart_without_a_checkpoint_raises_config_error_naming_resume_from_and_keeps_the_session(
    small_config: SessionConfig,
) -> None:
    from rlsdk.config import ConfigError

    async def scenario() -> tuple[str, int]:
        async with await Session.start(small_config) as session:
            with pytest.raises(ConfigError) as info:
                await session.restart()
            await _step(session)  # nothing was stopped
            return str(info.value), session.versions.trainer_version

    message, version = asyncio.run(scenario())

    assert "train.resume_from" in message
    assert version == 1


def test_restart_from_scratch_starts_new_ranks_at_version_zero(small_config: SessionConfig) -> None:
    async def scenario() -> tuple[list[int], list[int], int, Any]:
        async with await Session.start(small_config) as session:
            await _step(session)
            before = [info["pid"] for info in session.rank_info.values()]
            resumed = await session.restart(resume_from=None)
            after = [info["pid"] for info in session.rank_info.values()]
            return before, after, session.versions.trainer_version, resumed

    before, after, version, resumed = asyncio.run(scenario())

    assert resumed is None and version == 0
    assert not set(before) & set(after)
    assert not any(_alive(pid) for pid in before + after)


def test_unresponsive_rank_error_names_rank_pid_timeout_and_last_lines() -> None:
    error = RankUnresponsiveError(1, 4242, 3.2, 2.5, "update", ["INFO step 3"])

    assert "train rank 1 (pid 4242)" in str(error)
    assert "3.2 s" in str(error) and "heartbeat_timeout_s = 2.5" in str(error)
    assert "'update'" in str(error) and "INFO step 3" in str(error)
