"""reverse_reward: exact answers earn 1.0, anything else strictly less than PARTIAL_CREDIT_WEIGHT."""

from __future__ import annotations

import pytest

from rlsdk.rewards import PARTIAL_CREDIT_WEIGHT, reverse_reward


def test_reverse_reward_exact_answer_gives_one() -> None:
    assert reverse_reward(["321", " 406\n"], answer=["321", "406"]) == [1.0, 1.0]


@pytest.mark.parametrize(
    ("completion", "expected_fraction"),
    [
        ("", 0.0),
        ("123", 1 / 3),  # middle digit right
        ("32", 2 / 3),  # missing a digit
        ("3210", 3 / 4),  # all digits right, one extra
        ("32100", 3 / 5),
        ("999", 0.0),
        ("<pad>321", 0.0),  # positions shift: a stray special token is not ignored
    ],
)
def test_reverse_reward_inexact_answer_gives_partial_credit_below_weight(
    completion: str, expected_fraction: float
) -> None:
    (reward,) = reverse_reward([completion], answer=["321"])

    assert reward == pytest.approx(PARTIAL_CREDIT_WEIGHT * expected_fraction, abs=1e-12)
    assert reward < PARTIAL_CREDIT_WEIGHT


def test_reverse_reward_extra_columns_are_ignored() -> None:
    assert reverse_reward(["1"], answer=["1"], prompts=["1>"], id=[7]) == [1.0]


def test_reverse_reward_length_mismatch_raises_value_error() -> None:
    with pytest.raises(ValueError, match="completions has 2 items but answer has 1"):
        reverse_reward(["1", "2"], answer=["1"])
