"""MetricsWriter: every scalar of a step reaches TensorBoard under its tag and step; the history keeps them."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlsdk.observe.metrics import MetricsWriter


def _read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_log_several_scalars_per_step_are_readable_per_tag(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "tb", tensorboard=True)

    writer.log(1, {"reward/mean": 0.5, "train/loss": 2, "time/step_s": 0.25})
    writer.log(2, {"reward/mean": 0.75, "train/loss": 1.5})
    writer.log(3, {})
    writer.close()

    scalars = _read_scalars(tmp_path / "tb")
    assert set(scalars) == {"reward/mean", "train/loss", "time/step_s"}
    assert scalars["reward/mean"] == [(1, pytest.approx(0.5)), (2, pytest.approx(0.75))]
    assert scalars["train/loss"] == [(1, pytest.approx(2.0)), (2, pytest.approx(1.5))]
    assert scalars["time/step_s"] == [(1, pytest.approx(0.25))]


def test_log_non_finite_and_none_values_are_dropped_from_history_and_tensorboard(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "tb", tensorboard=True)

    writer.log(7, {"a": float("nan"), "b": None, "c": float("inf"), "d": 3})  # type: ignore[dict-item]
    writer.close()

    assert list(writer.history) == [(7, {"d": 3.0})]
    assert _read_scalars(tmp_path / "tb") == {"d": [(7, pytest.approx(3.0))]}


def test_log_without_tensorboard_keeps_bounded_history_and_writes_no_files(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "tb", tensorboard=False, history=2)

    for step in range(3):
        writer.log(step, {"x": step})
    writer.close()

    assert list(writer.history) == [(1, {"x": 1.0}), (2, {"x": 2.0})]
    assert not (tmp_path / "tb").exists()
