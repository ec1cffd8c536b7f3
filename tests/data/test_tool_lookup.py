"""The lookup tool task's pieces: code, call parser, tool, output format and rewards."""

from __future__ import annotations

import pytest

from rlsdk.data.tool_tasks import (
    TOOL_CALL,
    lookup_call,
    lookup_code,
    lookup_env,
    lookup_output,
    lookup_reward,
    tool_called_reward,
)


def test_lookup_code_is_a_deterministic_digit_string_of_the_key_digits() -> None:
    assert lookup_code("123>") == lookup_code("123") == f"{(123 * 7919 + 4057) % 10}"
    assert lookup_code("123>").isdigit()


def test_lookup_code_without_digits_raises_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"'>>'"):
        lookup_code(">>")


def test_lookup_call_calls_only_on_a_turn_ending_with_the_marker() -> None:
    assert lookup_call(f"12{TOOL_CALL}") == "lookup"
    assert lookup_call("12") is None


def test_lookup_env_answers_the_code_of_the_rows_prompt_and_output_ends_with_the_separator() -> None:
    assert lookup_env("lookup", {"prompt": "987>"}) == lookup_code("987>")
    assert lookup_output("4") == "4>"


def test_lookup_reward_scores_the_text_after_the_tools_output_not_the_output_itself() -> None:
    code = lookup_code("123>")
    wrong = str((int(code) + 1) % 10)

    rewards = lookup_reward(
        [f"|{code}>{code}", f"|{code}>{wrong}", f"|{code}>", f"|{code}>{code}|"], prompts=["123>"] * 4
    )

    assert rewards[0] == 1.0 and rewards[3] == 1.0  # a trailing call marker in the last turn is ignored
    assert rewards[1] < 0.5 and rewards[2] == 0.0


def test_tool_called_reward_needs_a_call_answered_by_the_tool() -> None:
    assert tool_called_reward(["|4>4", "4", "4|"]) == [1.0, 0.0, 0.0]
