"""The dashboard's data (staleness verdict, status text, log filters) and its widgets, against a fake session."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from rlsdk.observe.dashboard import LogBuffer, TextDashboard, filter_records, open_dashboard, svg_line_chart
from rlsdk.observe.logging import RankLogRouter
from rlsdk.observe.metrics import MetricsWriter
from rlsdk.observe.status import diverged_at, format_status_text, last_batch_staleness, merged_history, rank_alive


class FakeSession:
    """What the dashboard reads from a Session: status(), metrics.history, the log router, output_dir."""

    def __init__(self, tmp_path: Path) -> None:
        self.log_router = RankLogRouter(tmp_path / "logs", console=False, level=logging.DEBUG)
        self.metrics = MetricsWriter(tmp_path / "tb", tensorboard=False)
        self.output_dir = tmp_path
        self.closed = False
        self.trainer_version = 0
        self.engine_version = 0
        self.last_trace: Any = None
        self.last_trace_time: float | None = None
        self.hung: dict[str, Any] | None = None

    def status(self) -> dict[str, Any]:
        return {
            "closed": self.closed,
            "ranks": {r: {"pid": os.getpid(), "heartbeat_age_s": 0.2, "command": None, "alive": True} for r in (0, 1)},
            "trainer_version": self.trainer_version,
            "engine_version": self.engine_version,
            "in_sync": self.trainer_version == self.engine_version,
            "step": self.trainer_version,
            "last_batch": last_batch_staleness(self.metrics.history, 0),
            "hung": self.hung,
            "trace": None
            if self.last_trace is None
            else {
                "time": self.last_trace_time,
                "ok": self.last_trace.ok,
                "headline": str(self.last_trace).splitlines()[0],
                "diverged": diverged_at(self.last_trace),
            },
        }

    def step(self, reward: float, *, dropped: int = 0, behaviour_min: int | None = None) -> None:
        self.trainer_version += 1
        self.metrics.log(
            self.trainer_version,
            {
                "step": self.trainer_version,
                "reward/mean": reward,
                "train/loss": -reward,
                "train/kl": 0.0,
                "train/clip_fraction": 0.0,
                "train/dropped_stale": dropped,
                "time/rollout_s": 0.1,
                "time/update_s": 0.2,
                "version/trainer": self.trainer_version,
                "version/behaviour_min": self.trainer_version - 1 if behaviour_min is None else behaviour_min,
            },
        )
        self.engine_version = self.trainer_version
        self.metrics.log(self.trainer_version, {"time/sync_s": 0.05, "version/engine": self.engine_version})


def _record(rank: int | None, message: str, level: int = logging.INFO, component: str = "worker") -> dict:
    return {
        "time": time.time(),
        "level": logging.getLevelName(level),
        "levelno": level,
        "logger": f"rlsdk.{component}",
        "component": component,
        "rank": rank,
        "world_size": 2,
        "version": 0,
        "role": "train" if rank is not None else "controller",
        "message": message,
    }


def test_last_batch_staleness_before_any_update_is_none_then_on_policy_then_counts_dropped(tmp_path: Path) -> None:
    session = FakeSession(tmp_path)
    assert last_batch_staleness(session.metrics.history, 0) is None

    session.step(0.5)
    on_policy = last_batch_staleness(session.metrics.history, 0)
    session.step(0.6, dropped=16, behaviour_min=0)
    dropped = last_batch_staleness(session.metrics.history, 0)

    assert on_policy is not None and on_policy["verdict"] == "on-policy" and on_policy["staleness"] == 0
    assert dropped is not None and dropped["verdict"] == "dropped 16 stale samples" and dropped["staleness"] == 1


def test_merged_history_joins_update_and_sync_entries_of_one_step(tmp_path: Path) -> None:
    session = FakeSession(tmp_path)
    session.step(0.5)

    ((step, metrics),) = merged_history(session.metrics.history)

    assert step == 1 and metrics["reward/mean"] == 0.5 and metrics["time/sync_s"] == 0.05


def test_format_status_text_names_versions_last_batch_ranks_and_latest_metrics(tmp_path: Path) -> None:
    session = FakeSession(tmp_path)
    session.step(0.25)

    text = format_status_text(session.status(), session.metrics.history)

    assert "trainer published v1, engine serves v1 (in sync)" in text
    assert "last batch: on-policy" in text
    assert "rank 1: alive" in text
    assert "reward 0.25" in text and "step time (s) 0.35" in text


def test_rank_alive_needs_a_live_pid_and_a_fresh_heartbeat() -> None:
    assert rank_alive(os.getpid(), 0.5, heartbeat_timeout_s=30.0)
    assert not rank_alive(os.getpid(), 31.0, heartbeat_timeout_s=30.0)
    assert not rank_alive(None, 0.5, heartbeat_timeout_s=30.0)


def test_log_buffer_keeps_only_the_newest_records_and_counts_all() -> None:
    buffer = LogBuffer(maxlen=3)
    for i in range(10):
        buffer(_record(0, f"m{i}"))

    assert [r["message"] for r in buffer.snapshot()] == ["m7", "m8", "m9"]
    assert buffer.total == 10


def test_filter_records_by_source_level_and_component() -> None:
    records = [
        _record(0, "r0 info"),
        _record(1, "r1 debug", logging.DEBUG),
        _record(1, "r1 warn", logging.WARNING, component="engine"),
        _record(None, "controller info", component="session"),
    ]

    assert [r["message"] for r in filter_records(records, source="rank 1")] == ["r1 debug", "r1 warn"]
    assert [r["message"] for r in filter_records(records, min_level="WARNING")] == ["r1 warn"]
    assert [r["message"] for r in filter_records(records, component="session")] == ["controller info"]
    assert [r["message"] for r in filter_records(records, source="controller")] == ["controller info"]


def test_svg_line_chart_without_points_says_no_data_and_with_points_shows_last_value() -> None:
    assert "no data yet" in svg_line_chart([], "reward")
    chart = svg_line_chart([(1, 0.1), (2, 0.5), (3, 0.25)], "reward")
    assert "<polyline" in chart and "0.25 @ 3" in chart


def test_widget_dashboard_shows_versions_and_filters_logs_by_rank(tmp_path: Path) -> None:
    pytest.importorskip("ipywidgets")
    session = FakeSession(tmp_path)
    session.step(0.5)
    session.log_router.handle(_record(0, "hello from rank zero"))
    session.log_router.handle(_record(1, "hello from rank one"))

    dashboard = open_dashboard(session, mode="widget")
    dashboard.refresh()
    dashboard.source.value = "rank 1"

    assert "trainer published</td><td><b>v1</b>" in dashboard._versions.value
    assert "on-policy" in dashboard._versions.value
    assert "hello from rank one" in dashboard._logs.value and "rank zero" not in dashboard._logs.value
    assert "rank 0" in dashboard.source.options and "rank 1" in dashboard.source.options
    assert "reward" in dashboard._metrics.value and "<polyline" in dashboard._metrics.value
    dashboard.close()


def test_widget_dashboard_refreshes_from_its_loop_task_under_a_log_flood_with_bounded_output(tmp_path: Path) -> None:
    pytest.importorskip("ipywidgets")
    session = FakeSession(tmp_path)

    async def scenario() -> tuple[Any, float]:
        dashboard = open_dashboard(session, mode="widget", interval_s=0.02)
        lags = []
        for i in range(2000):  # 4 ranks, 500 records each, delivered on the loop like the control channel does
            session.log_router.handle(_record(i % 4, f"record {i}"))
            if i % 200 == 0:
                before = time.perf_counter()
                await asyncio.sleep(0)
                lags.append(time.perf_counter() - before)
        session.step(0.75)
        await asyncio.sleep(0.2)
        session.closed = True
        await asyncio.sleep(0.1)
        return dashboard, max(lags)

    dashboard, lag = asyncio.run(scenario())

    assert "record 1999" in dashboard._logs.value  # the task rendered the newest records by itself
    assert dashboard._logs.value.count("\n") < dashboard.max_lines
    assert "v1" in dashboard._versions.value
    assert dashboard._task is None or dashboard._task.done()  # stopped once the session closed
    assert lag < 1.0


def test_text_dashboard_logs_status_text_and_reprs_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    session = FakeSession(tmp_path)
    session.step(0.5)

    dashboard = open_dashboard(session, mode="text")
    with caplog.at_level(logging.INFO, logger="rlsdk.observe.dashboard"):
        dashboard.refresh()

    assert isinstance(dashboard, TextDashboard)
    assert "engine serves v1" in repr(dashboard)
    assert any("engine serves v1" in r.getMessage() for r in caplog.records)


def test_opening_a_second_dashboard_for_a_session_closes_the_first(tmp_path: Path) -> None:
    session = FakeSession(tmp_path)

    first = open_dashboard(session, mode="text")
    second = open_dashboard(session, mode="text")
    session.log_router.handle(_record(0, "after the second view opened"))

    assert first.logs.closed and not second.logs.closed
    assert [r["message"] for r in second.logs.snapshot()] == ["after the second view opened"]
    second.close()


def _diverged_trace() -> Any:
    from rlsdk.debug.analyze import analyze

    def record(seq: int, op: str, site: str, *, done: bool = True) -> dict[str, Any]:
        now = time.time()
        return {"group": "0", "seq": seq, "op": op, "shapes": [[4]], "dtypes": ["float32"], "reduce_op": "SUM",
                "root": None, "site": site, "stack": [], "t_start": now - 5, "t_end": now - 4 if done else None,
                "command": "call_function", "command_seq": 3}  # fmt: skip

    states = {
        0: {
            "rank": 0,
            "records": [record(1, "allreduce", "a.py:1"), record(2, "allreduce", "hang.py:9", done=False)],
            "command": "call_function",
            "now": time.time(),
        },
        1: {"rank": 1, "records": [record(1, "allreduce", "a.py:1")], "command": None, "now": time.time()},
    }
    return analyze(states)


def test_widget_dashboard_tracer_view_highlights_the_divergence_and_offers_keep_waiting_while_hung(
    tmp_path: Path,
) -> None:
    pytest.importorskip("ipywidgets")
    session = FakeSession(tmp_path)
    dashboard = open_dashboard(session, mode="widget")
    before = dashboard._tracer.value
    hidden_before = dashboard.keep_waiting_button.layout.display

    session.last_trace, session.last_trace_time = _diverged_trace(), time.time()
    session.hung = {"command": "call_function", "seconds": 12.0, "kind": "extra collective", "path": "/x/report"}
    dashboard.refresh()

    assert "no collective trace yet" in before and hidden_before == "none"
    assert "HUNG" in dashboard._tracer.value and "extra collective" in dashboard._tracer.value
    assert "background:#fdd" in dashboard._tracer.value and "hang.py:9" in dashboard._tracer.value
    assert dashboard.keep_waiting_button.layout.display is None
    assert dashboard.terminate_button.layout.display is None
    dashboard.close()


def test_format_status_text_shows_rank_progress_the_latest_trace_and_a_hang() -> None:
    status = {
        "step": 3,
        "ranks": {0: {"pid": 1, "heartbeat_age_s": 0.1, "command": "update", "progress": (2, 8), "alive": True}},
        "trace": {"time": time.time(), "ok": False, "headline": "COLLECTIVE DIVERGENCE: extra collective"},
        "hung": {"command": "update", "seconds": 40.0, "kind": "extra collective", "path": "/x"},
    }

    text = format_status_text(status)

    assert "update (2/8)" in text
    assert "COLLECTIVE DIVERGENCE: extra collective" in text
    assert "HUNG: command update for 40 s" in text and "keep_waiting" in text


def test_widget_dashboard_shows_diverged_at_within_one_refresh_of_the_divergence_being_known(tmp_path: Path) -> None:
    pytest.importorskip("ipywidgets")

    async def scenario() -> tuple[str, str, str, float]:
        session = FakeSession(tmp_path)
        dashboard = open_dashboard(session, mode="widget", interval_s=0.05)
        before = dashboard._title.value
        session.last_trace, session.last_trace_time = _diverged_trace(), time.time()  # the watchdog's on_report
        known = time.monotonic()
        while "diverged at" not in dashboard._title.value and time.monotonic() - known < 5.0:
            await asyncio.sleep(0.01)
        shown_after = time.monotonic() - known
        dashboard.close()
        return before, dashboard._title.value, dashboard._tracer.value, shown_after

    before, title, tracer, shown_after = asyncio.run(scenario())

    assert "diverged" not in before
    expected = "diverged at group 0 seq 2: missing collective on rank(s) [1] (allreduce at hang.py:9"
    assert expected in title and expected in tracer
    assert "rlsdk-diverged" in tracer
    assert shown_after < 1.0  # the refresh task picked it up, no cell had to run


def test_straggler_is_not_shown_as_diverged() -> None:
    from rlsdk.debug.analyze import Divergence, TraceReport

    straggler = TraceReport(Divergence("straggler", [1], "0", 2, [], "rank 1 is slow"), {})

    assert diverged_at(straggler) is None
    assert diverged_at(TraceReport(None, {})) is None


def test_format_status_text_says_diverged_at() -> None:
    status = {
        "step": 1,
        "ranks": {},
        "trace": {"time": time.time(), "ok": False, "headline": "COLLECTIVE DIVERGENCE: op mismatch",
                  "diverged": "diverged at group 0 seq 4: op mismatch on rank(s) [1] (broadcast at p.py:3)"},
    }  # fmt: skip

    assert "DIVERGED: diverged at group 0 seq 4: op mismatch" in format_status_text(status)
