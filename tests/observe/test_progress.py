"""Session.start's phase bar: advances phase by phase, completes at the last one, and is a no-op when disabled."""

from __future__ import annotations

import pytest

from rlsdk.observe.progress import START_PHASES, PhaseProgress


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
