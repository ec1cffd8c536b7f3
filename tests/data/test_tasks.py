"""Generated tasks: arithmetic answers are exact, countdown puzzles are solvable, both seeded."""

from __future__ import annotations

import pytest

from rlsdk.data import arithmetic_dataset, countdown_dataset
from rlsdk.rewards import exact_match


def _evaluate(prompt: str) -> int:
    for op in ("+", "-", "*"):
        left, sep, right = prompt[:-1].partition(op)
        if sep and left and right.isdigit():
            a, b = int(left), int(right)
            return a + b if op == "+" else a - b if op == "-" else a * b
    raise AssertionError(f"unexpected prompt {prompt!r}")


def test_arithmetic_dataset_answers_are_exact_results_of_prompts() -> None:
    dataset = arithmetic_dataset(100, min_digits=1, max_digits=3, seed=5)

    for prompt, answer in zip(dataset["prompt"], dataset["answer"]):
        assert prompt.endswith("=")
        assert int(answer) == _evaluate(prompt)
    assert exact_match()(list(dataset["answer"]), answer=list(dataset["answer"])) == [1.0] * 100


def test_arithmetic_dataset_operations_subset_uses_only_those() -> None:
    dataset = arithmetic_dataset(30, operations=("*",), seed=0)

    assert all("*" in p and "+" not in p and "-" not in p for p in dataset["prompt"])


def test_countdown_dataset_rows_have_numbers_of_requested_size_and_positive_target() -> None:
    dataset = countdown_dataset(40, num_numbers=4, min_digits=2, max_digits=2, seed=2)

    for numbers, target, prompt in zip(dataset["numbers"], dataset["target"], dataset["prompt"]):
        assert len(numbers) == 4
        assert all(10 <= n <= 99 for n in numbers)
        assert target >= 1
        assert str(numbers) in prompt and str(target) in prompt


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: arithmetic_dataset(0), "num_examples=0"),
        (lambda: arithmetic_dataset(5, operations=("/",)), "operations"),
        (lambda: countdown_dataset(5, num_numbers=1), "num_numbers=1"),
        (lambda: countdown_dataset(5, min_digits=3, max_digits=2), "min_digits=3, max_digits=2"),
    ],
)
def test_generated_task_bad_arguments_raise_value_error_naming_argument(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]
