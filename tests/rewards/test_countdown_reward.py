"""countdown_reward: exact arithmetic on an ast walk; code, reuse and foreign numbers earn 0 and never run."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlsdk.data import countdown_dataset
from rlsdk.rewards import check_countdown, countdown_reward, extract_expression


@pytest.mark.parametrize(
    "expression",
    ["(25 - 5) * 2", "25*2 - 5 - 5", "2 * (25 - 5)", "((25-5))*2", "40"],
)
def test_check_countdown_valid_expression_reaching_target_is_accepted(expression: str) -> None:
    numbers = [25, 5, 2, 5, 40]

    assert check_countdown(expression, numbers, 40)


def test_check_countdown_division_is_exact_not_floating_point() -> None:
    assert check_countdown("(1 + 2) / 3 * 9", [1, 2, 3, 9], 9)
    assert not check_countdown("7 / 2", [7, 2], 3)


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("5 + 5", "5 offered once, used twice"),
        ("25 + 15", "15 not offered"),
        ("-5 + 45", "unary minus makes a number not offered"),
        ("25 / (5 - 5)", "division by zero"),
        ("25 ** 2", "power is not an allowed operator"),
        ("25 + 5.0", "float literal"),
        ("", "empty"),
        ("25 +", "syntax error"),
        ("(" * 300 + "1" + ")" * 300, "too long to parse"),
    ],
)
def test_check_countdown_invalid_expression_is_refused(expression: str, why: str) -> None:
    assert not check_countdown(expression, [25, 5, 2], 30), why


@pytest.mark.parametrize(
    "injection",
    [
        "__import__('pathlib').Path('{marker}').touch()",
        "open('{marker}', 'w')",
        "[p for p in ().__class__.__base__.__subclasses__()]",
        "(lambda: open('{marker}', 'w'))()",
        "{{}}.get(1) or 30",
    ],
)
def test_countdown_reward_code_injection_earns_zero_and_never_runs(tmp_path: Path, injection: str) -> None:
    marker = tmp_path / "pwned"

    scores = countdown_reward([f"<answer>{injection.format(marker=marker)}</answer>"], numbers=[[30]], target=[30])

    assert scores == [0.0]
    assert not marker.exists()


def test_countdown_reward_uses_last_answer_tag_or_last_line() -> None:
    completions = [
        "<answer>1 + 1</answer> no wait <answer>(25 - 5) * 2</answer>",
        "think...\n(25 - 5) * 2 = 40\n",
        "<answer>25 + 5 + 2</answer>",
    ]

    scores = countdown_reward(completions, numbers=[[25, 5, 2]] * 3, target=[40, 40, 40])

    assert scores == [1.0, 1.0, 0.0]


def test_extract_expression_drops_everything_from_the_equals_sign() -> None:
    assert extract_expression("<answer> 25+21 = 46 </answer>") == "25+21"


def test_countdown_reward_generated_solutions_all_score_one() -> None:
    dataset = countdown_dataset(50, num_numbers=4, seed=3)

    scores = countdown_reward(
        [f"<answer>{s}</answer>" for s in dataset["solution"]], numbers=dataset["numbers"], target=dataset["target"]
    )

    assert scores == [1.0] * 50


def test_countdown_reward_length_mismatch_raises_value_error() -> None:
    with pytest.raises(ValueError, match="completions has 2 items, numbers 1 and target 1"):
        countdown_reward(["1", "2"], numbers=[[1]], target=[1])
