"""Progress bars: Session.start's phase bar, and the per-call bar of rollout/update (opened only for slow calls)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rlsdk.observe.progress import START_PHASES, CallProgress, PhaseProgress, progress_sink


def test_phase_progress_advances_to_each_named_phase_and_completes_at_the_last(
    capsys: pytest.CaptureFixture[str],
) -> None:
    progress = PhaseProgress(START_PHASES, desc="Session.start", enabled=True)

    progress(START_PHASES[1])
    middle = progress._bar.n
    progress(START_PHASES[-1])
    done = progress._bar.n
    progress.close()
    progress.close()  # idempotent

    assert (middle, done) == (1, len(START_PHASES))
    assert "Session.start" in capsys.readouterr().err


def test_phase_progress_disabled_outside_jupyter_by_default_draws_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    progress = PhaseProgress(START_PHASES, desc="Session.start")
    progress(START_PHASES[0])
    progress.close()

    assert progress._bar is None
    assert capsys.readouterr().err == ""


def test_call_progress_quicker_than_its_delay_opens_no_bar(capsys: pytest.CaptureFixture[str]) -> None:
    async def call() -> CallProgress:
        with CallProgress("rollout", total=8, unit="sample", enabled=True, delay_s=5.0) as progress:
            sink = progress_sink()
            assert sink is not None
            sink(8)
        return progress

    progress = asyncio.run(call())

    assert not progress.shown and progress.done == 8
    assert capsys.readouterr().err == ""
    assert progress_sink() is None  # reset after the call


def test_call_progress_slow_call_shows_the_sink_count_and_postfix_then_completes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[int] = []

    async def call() -> CallProgress:
        with CallProgress(
            "rollout", total=4, unit="sample", postfix=lambda: "engine v7", enabled=True, delay_s=0.0, interval_s=0.02
        ) as progress:
            for _ in range(3):
                await asyncio.sleep(0.06)
                progress_sink()(1)  # type: ignore[misc]
                seen.append(progress._bar.n if progress.shown else -1)
        return progress

    progress = asyncio.run(call())

    err = capsys.readouterr().err
    assert "rollout" in err and "engine v7" in err and "4/4" in err  # completed on exit
    assert seen[-1] >= 1 and progress.done == 3
    assert not progress.shown  # closed


def test_call_progress_poll_sets_done_and_total(capsys: pytest.CaptureFixture[str]) -> None:
    polled = [(0, 0)]

    async def call() -> None:
        with CallProgress("update", unit="micro-batch", poll=lambda: polled[-1], enabled=True, delay_s=0.0,
                          interval_s=0.02) as progress:  # fmt: skip
            polled.append((3, 8))
            await asyncio.sleep(0.1)
            assert (progress._bar.n, progress._bar.total) == (3, 8)

    asyncio.run(call())

    assert "8/8" in capsys.readouterr().err


def test_call_progress_rejects_a_negative_delay() -> None:
    with pytest.raises(ValueError, match="delay_s"):
        CallProgress("x", delay_s=-1.0)


def test_embedded_engine_reports_each_chunk_to_the_call_progress(tmp_path: Path) -> None:
    from rlsdk.data import build_tiny_policy
    from rlsdk.engine.inference.embedded import EmbeddedEngine
    from rlsdk.engine.inference.protocol import SamplingParams

    build_tiny_policy(tmp_path / "policy", seed=0)
    engine = EmbeddedEngine.from_pretrained(str(tmp_path / "policy"), max_batch_size=2)

    async def call() -> CallProgress:
        try:
            with CallProgress("rollout", total=5, enabled=True, delay_s=60.0) as progress:
                await engine.generate([[1, 2, 3]] * 5, SamplingParams(max_new_tokens=2, seed=0))
            return progress
        finally:
            await engine.close()

    assert asyncio.run(call()).done == 5


def test_phase_progress_records_the_seconds_of_each_finished_phase_even_when_disabled() -> None:
    progress = PhaseProgress(START_PHASES, desc="Session.start", enabled=False)

    for phase in START_PHASES:
        progress(phase)
    progress.close()

    assert list(progress.seconds) == list(START_PHASES[:-1])  # 'ready' ends the bar, it takes no time
    assert all(seconds >= 0.0 for seconds in progress.seconds.values())
