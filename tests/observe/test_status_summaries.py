"""The parts of Session.status() built from the hang watchdog's objects: pure, and None when there is nothing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from rlsdk.observe.status import hung_summary, trace_summary


def test_trace_summary_without_a_trace_is_none_and_with_one_gives_its_headline_and_time() -> None:
    class Report:
        ok = True
        divergence = None

        def __str__(self) -> str:
            return "all ranks agree\nmore detail"

    assert trace_summary(None, None) is None
    summary = trace_summary(Report(), 12.5)
    assert summary == {"time": 12.5, "ok": True, "headline": "all ranks agree", "diverged": None}


def test_hung_summary_names_the_command_its_age_kind_and_saved_report_path() -> None:
    hung = SimpleNamespace(
        command="update",
        seconds=31.0,
        report=SimpleNamespace(divergence=SimpleNamespace(kind="mismatch")),
        path=Path("/tmp/out/traces/hang.json"),
    )

    assert hung_summary(None) is None
    assert hung_summary(hung) == {
        "command": "update",
        "seconds": 31.0,
        "kind": "mismatch",
        "path": "/tmp/out/traces/hang.json",
    }
