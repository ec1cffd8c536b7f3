"""The hang watchdog's offer after a CollectiveHangError: the hung command stays pending, new commands are refused,
keep_waiting() returns its results when the ranks get out, or times out leaving it pending."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from rlsdk.debug.analyze import Divergence, TraceReport
from rlsdk.debug.watchdog import CollectiveHangError, WatchedControllerChannel


def _hang_report() -> TraceReport:
    record = {"op": "allreduce", "seq": 3, "shapes": [[4]], "dtypes": ["float32"], "site": "demo.py:7"}
    divergence = Divergence(
        kind="extra collective",
        ranks=[0],
        group="0",
        seq=3,
        sides=[{"rank": 0, "record": record, "state": "waiting"}, {"rank": 1, "record": None, "state": "idle"}],
        message="rank 0 called allreduce seq 3 that rank 1 never called",
    )
    return TraceReport(divergence=divergence, states={0: {"rank": 0}, 1: {"rank": 1}})


def _channel(tmp_path: Path, reports: list[TraceReport]) -> WatchedControllerChannel:
    channel = WatchedControllerChannel(
        b"secret",
        "session",
        hang_timeout_s=0.05,
        hang_policy="raise",
        traces_dir=tmp_path / "traces",
        world_size=2,
        on_report=reports.append,
    )

    async def trace(*, timeout_s: float = 2.0) -> TraceReport:
        report = _hang_report()
        channel._report(report)
        return report

    channel.trace = trace  # type: ignore[method-assign]  # the ranks' answers, without ranks
    return channel


def test_hung_command_refuses_new_commands_then_keep_waiting_returns_its_late_results(tmp_path: Path) -> None:
    reports: list[TraceReport] = []

    async def scenario() -> tuple[CollectiveHangError, str, list[Any], Any]:
        channel = _channel(tmp_path, reports)
        task: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        with pytest.raises(CollectiveHangError) as caught:
            await channel._watch("call_function", task, time.monotonic())
        with pytest.raises(RuntimeError) as refused:
            await channel.broadcast("update")
        asyncio.get_running_loop().call_later(0.2, task.set_result, [{"rank": 0}, {"rank": 1}])
        results = await channel.keep_waiting(timeout_s=10.0)
        return caught.value, str(refused.value), results, channel.hung

    error, refused, results, hung_after = asyncio.run(scenario())

    assert "keep_waiting" in str(error) and "close" in str(error)
    assert error.path is not None and (error.path / "report.txt").is_file()
    assert "cannot send 'update'" in refused and "'call_function' is still hung" in refused
    assert results == [{"rank": 0}, {"rank": 1}]
    assert hung_after is None
    assert reports and all(not r.ok for r in reports)


def test_keep_waiting_times_out_and_leaves_the_command_pending(tmp_path: Path) -> None:
    async def scenario() -> tuple[str, bool]:
        channel = _channel(tmp_path, [])
        task: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        with pytest.raises(CollectiveHangError):
            await channel._watch("update", task, time.monotonic())
        with pytest.raises(TimeoutError) as caught:
            await channel.keep_waiting(timeout_s=0.2)
        pending = channel.hung is not None and not task.done()
        task.cancel()
        return str(caught.value), pending

    message, pending = asyncio.run(scenario())

    assert "'update' is still hung" in message
    assert pending


def test_keep_waiting_without_a_hung_command_says_so(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="no command is hung"):
        asyncio.run(_channel(tmp_path, []).keep_waiting())
