"""The warnings an RL update raises from its own statistics: pure checks that log, and say whether they decided."""

from __future__ import annotations

import logging

import pytest
import torch

from rlsdk.observe.update_checks import check_entropy_bonus, warn_on_disagreement


def _agreement(mean: float) -> dict[str, float]:
    return {
        "agreement/logprob_absdiff_mean": mean,
        "agreement/logprob_absdiff_max": 4 * mean,
        "agreement/ratio_min": 0.5,
        "agreement/ratio_max": 1.5,
        "agreement/tokens": 40.0,
    }


def _warn(mean: float) -> bool:
    return warn_on_disagreement(
        _agreement(mean),
        step=3,
        threshold=0.1,
        compared_version=2,
        served_dtype="bfloat16",
        trained_dtype="float32",
    )


def test_warn_on_disagreement_above_the_threshold_warns_naming_the_dtypes(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rlsdk"):
        warned = _warn(0.25)

    assert warned
    assert "update 3: trainer and engine disagree" in caplog.text
    assert "engine serves bfloat16, trainer computes in float32" in caplog.text
    assert "over the 40 tokens of rows sampled wholly by the trainer's v2" in caplog.text


def test_warn_on_disagreement_at_or_below_the_threshold_stays_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rlsdk"):
        warned = _warn(0.1)

    assert not warned
    assert caplog.text == ""


def test_check_entropy_bonus_without_signal_is_undecided_and_a_large_bonus_warns_once_decided(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="rlsdk"):
        undecided = check_entropy_bonus(0.5, 2.0, torch.zeros(4), vocab=16, step=1)
        zero_coef = check_entropy_bonus(0.0, 2.0, torch.ones(4), vocab=16, step=1)
        decided = check_entropy_bonus(0.5, 4.0, torch.ones(4), vocab=16, step=2)  # bonus 2.0 > mean |A| 1.0

    assert (undecided, zero_coef, decided) == (False, False, True)
    assert caplog.text.count("algorithm.entropy_coef=0.5") == 1
    assert "of update 2" in caplog.text


def test_warn_on_disagreement_with_no_row_of_the_trainer_version_stays_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rlsdk"):
        warned = _warn(float("nan"))

    assert not warned
    assert caplog.text == ""
