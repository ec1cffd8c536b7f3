"""A real Session: a custom rank command that hangs in a collective is reported by the watchdog's live check,
seconds after the diverging call (the default config: launch.hang_timeout_s stays 30 s)."""

from __future__ import annotations

import asyncio
import os
import time
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


def test_rank0_broadcast_under_rank_condition_raises_within_5s_naming_rank_op_and_call_site(
    small_config: SessionConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(Path(_faults.__file__).parent), os.environ.get("PYTHONPATH")]))
    )  # the ranks import _faults
    config = small_config
    assert config.launch.hang_timeout_s == 30.0 and config.launch.trace_poll_s == 1.0  # the defaults

    async def scenario() -> tuple[CollectiveHangError, float, str, list[int], dict[str, Any], str, str]:
        session = await Session.start(config)
        try:
            pids = [info["pid"] for info in session.rank_info.values()]
            assert (await session.trace()).ok
            with pytest.raises(CollectiveHangError) as caught:
                await session.call("call_function", {"target": "_faults:session_rank0_broadcast"})
            raised_at = time.monotonic()
            live = str(await session.trace())
            status = session.status()
            with pytest.raises(RuntimeError) as refused:
                await session.call("noop")
            with pytest.raises(TimeoutError) as waited:
                await session.keep_waiting(timeout_s=1.0)
            assert session.hung_command is not None and not session.last_trace.ok
        finally:
            await session.close()  # terminates the hung ranks
        return caught.value, raised_at, live, pids, status, str(refused.value), str(waited.value)

    error, raised_at, live, pids, status, refused, waited = asyncio.run(scenario())

    div = error.report.divergence
    assert div is not None and (div.kind, div.ranks, div.certain) == ("extra collective", [0], True)
    call = next(side["record"] for side in div.sides if side["rank"] == 0)
    assert raised_at - call["t_start"] <= 5.0  # not hang_timeout_s: two live polls and one full trace
    line = next(
        n for n, text in enumerate(Path(_faults.__file__).read_text().splitlines(), 1) if "SESSION_BROADCAST" in text
    )
    assert f"_faults.py:{line}" in str(error) and "broadcast" in str(error) and "call_function" in str(error)
    assert error.path is not None and (error.path / "report.txt").is_file()
    assert load_report(Path(config.observe.output_dir)).divergence.kind == "extra collective"
    assert "extra collective" in live
    stacks = error.report.states[0]["stacks"]
    assert any("session_rank0_broadcast" in "".join(frames) for frames in stacks.values())
    assert not any(_alive(pid) for pid in pids)
    # the offer: the command stays pending, new commands are refused, keep_waiting() waits on it
    assert "keep_waiting()" in str(error) and "close()" in str(error)
    assert status["hung"]["command"] == "call_function" and status["hung"]["kind"] == "extra collective"
    assert status["trace"] is not None and not status["trace"]["ok"]
    assert status["trace"]["diverged"].startswith("diverged at group 0 seq ")  # what the dashboard shows
    assert "cannot send 'noop'" in refused and "still hung" in refused
    assert "still hung" in waited
