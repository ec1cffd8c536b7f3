"""Built-in rewards on hand-made cases: exact match, format, length penalty, math answers."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from rlsdk.data import build_tokenizer
from rlsdk.rewards import exact_match, format_match, length_penalty, math_reward

HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None
needs_math_verify = pytest.mark.skipif(
    not HAS_MATH_VERIFY, reason="math-verify is not installed: pip install 'rlsdk[math]'"
)


def test_exact_match_default_strips_whitespace_and_keeps_case() -> None:
    reward = exact_match()

    assert reward([" 19\n", "19", "Yes", "20"], answer=["19", 19, "yes", "19"], prompts=["p"] * 4) == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]


def test_exact_match_ignore_case_without_strip_compares_casefolded_raw_text() -> None:
    reward = exact_match(strip=False, ignore_case=True)

    assert reward(["YES", " yes"], answer=["yes", "yes"]) == [1.0, 0.0]


def test_exact_match_other_column_reads_that_column() -> None:
    reward = exact_match(column="label")

    assert reward(["a", "b"], label=["a", "a"], answer=["b", "b"]) == [1.0, 0.0]


def test_exact_match_missing_column_raises_value_error_listing_columns() -> None:
    with pytest.raises(ValueError, match=r"needs the column 'answer'; the rows have \['prompts'\]"):
        exact_match()(["a"], prompts=["p"])


@pytest.mark.parametrize(
    ("full", "expected"),
    [(False, [1.0, 1.0, 0.0]), (True, [1.0, 0.0, 0.0])],
)
def test_format_match_search_or_full_match_scores_matching_completions(full: bool, expected: list[float]) -> None:
    reward = format_match(r"<answer>.*</answer>", flags=re.DOTALL, full=full)

    scores = reward(["<answer>4\n</answer>", "so <answer>4</answer>", "4"], answer=["4"] * 3)

    assert scores == expected


def test_format_match_bad_pattern_raises_value_error_naming_pattern() -> None:
    with pytest.raises(ValueError, match=r"format_match pattern '\(' does not compile"):
        format_match("(")


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (10, -1.0), (25, -1.0)],
)
def test_length_penalty_linear_beyond_soft_limit_reaches_minus_penalty_at_max(length: int, expected: float) -> None:
    reward = length_penalty(10, 4)  # soft zone: 6 < n <= 10 characters

    (score,) = reward(["x" * length])

    assert score == pytest.approx(expected, abs=1e-12)


def test_length_penalty_with_tokenizer_counts_tokens_and_scales_by_penalty() -> None:
    reward = length_penalty(6, 4, penalty=0.5, tokenizer=build_tokenizer())

    scores = reward(["12", "123", "1234", "12345678"])

    assert scores == pytest.approx([0.0, -0.125, -0.25, -0.5], abs=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_length": 0, "buffer_length": 1}, "max_length=0"),
        ({"max_length": 4, "buffer_length": 5}, "buffer_length=5"),
        ({"max_length": 4, "buffer_length": 2, "penalty": -1.0}, "penalty=-1.0"),
    ],
)
def test_length_penalty_bad_arguments_raise_value_error_naming_argument(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        length_penalty(**kwargs)


@needs_math_verify
@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("\\frac{1}{2}", "0.5"),
        ("The answer is $0.5$.", "\\frac{1}{2}"),
        ("so the result is \\boxed{\\frac12}", "1/2"),
        ("$1 + x$", "x+1"),
        ("\\boxed{42}", 42),
    ],
)
def test_math_reward_equivalent_answer_gives_one(completion: str, answer: object) -> None:
    assert math_reward([completion], answer=[answer]) == [1.0]


@needs_math_verify
@pytest.mark.parametrize(
    ("completion", "answer"),
    [("\\boxed{3}", "4"), ("$x + 2$", "x+1"), ("I do not know", "7"), ("", "1")],
)
def test_math_reward_wrong_or_missing_answer_gives_zero(completion: str, answer: str) -> None:
    assert math_reward([completion], answer=[answer]) == [0.0]


@needs_math_verify
def test_math_reward_in_worker_thread_runs_without_signal_timeouts() -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        scores = pool.submit(math_reward, ["\\boxed{0.5}", "\\boxed{2}"], answer=["1/2", "3"]).result()

    assert scores == [1.0, 0.0]


@needs_math_verify
def test_math_reward_unparseable_reference_raises_value_error_naming_index() -> None:
    with pytest.raises(ValueError, match=r"answer\[1\]='' could not be parsed"):
        math_reward(["1", "2"], answer=["1", ""])


def test_math_reward_without_extra_raises_import_error_naming_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail

    with pytest.raises(ImportError, match=r"rlsdk\[math\]"):
        math_reward(["1"], answer=["1"])
