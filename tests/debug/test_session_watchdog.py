"""A real Session: a custom rank command that hangs in a collective is reported by the watchdog."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import Any

import _faults
import psutil
import pytest

from rlsdk import Session, SessionConfig
from rlsdk.debug.analyze import load_report
from rlsdk.debug.watchdog import CollectiveHangError

pytestmark = pytest.mark.distributed


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_command_hanging_in_a_rank0_only_collective_raises_naming_rank_op_and_call_site(
    small_config: SessionConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(Path(_faults.__file__).parent), os.environ.get("PYTHONPATH")]))
    )  # the ranks import _faults
    config = dataclasses.replace(small_config, launch=dataclasses.replace(small_config.launch, hang_timeout_s=2.0))

    async def scenario() -> tuple[CollectiveHangError, str, list[int], dict[str, Any], str, str]:
        session = await Session.start(config)
        try:
            pids = [info["pid"] for info in session.rank_info.values()]
            assert (await session.trace()).ok
            with pytest.raises(CollectiveHangError) as caught:
                await session.call("call_function", {"target": "_faults:session_hang"})
            live = str(await session.trace())
            status = session.status()
            with pytest.raises(RuntimeError) as refused:
                await session.call("noop")
            with pytest.raises(TimeoutError) as waited:
                await session.keep_waiting(timeout_s=1.0)
            assert session.hung_command is not None and not session.last_trace.ok
        finally:
            await session.close()  # terminates the hung ranks
        return caught.value, live, pids, status, str(refused.value), str(waited.value)

    error, live, pids, status, refused, waited = asyncio.run(scenario())

    div = error.report.divergence
    assert div is not None and (div.kind, div.ranks) == ("extra collective", [0])
    line = next(
        n for n, text in enumerate(Path(_faults.__file__).read_text().splitlines(), 1) if "SESSION_HANG" in text
    )
    assert f"_faults.py:{line}" in str(error) and "allreduce" in str(error) and "call_function" in str(error)
    assert error.path is not None and (error.path / "report.txt").is_file()
    assert load_report(Path(config.observe.output_dir)).divergence.kind == "extra collective"
    assert "extra collective" in live
    stacks = error.report.states[0]["stacks"]
    assert any("session_hang" in "".join(frames) for frames in stacks.values())
    assert not any(_alive(pid) for pid in pids)
    # the offer: the command stays pending, new commands are refused, keep_waiting() waits on it
    assert "keep_waiting()" in str(error) and "close()" in str(error)
    assert status["hung"]["command"] == "call_function" and status["hung"]["kind"] == "extra collective"
    assert status["trace"] is not None and not status["trace"]["ok"]
    assert "cannot send 'noop'" in refused and "still hung" in refused
    assert "still hung" in waited
