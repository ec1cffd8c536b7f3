"""Procedurally generated tasks beyond reverse-digits: integer arithmetic and countdown.

Both are deterministic for a seed, need no download, and come with a reward: :func:`arithmetic_dataset` with
:func:`rlsdk.rewards.exact_match` (its ``answer`` column), :func:`countdown_dataset` with
:func:`rlsdk.rewards.countdown_reward` (its ``numbers`` and ``target`` columns).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets

ARITHMETIC_OPERATIONS = ("+", "-", "*")
COUNTDOWN_PROMPT = (
    "Using the numbers {numbers}, create an expression that equals {target}. You may use +, -, *, / and "
    "parentheses, and each number at most once. Give only the expression inside <answer> </answer>, "
    "for example <answer>(1 + 2) * 3</answer>."
)


def _check_common(num_examples: int, min_digits: int, max_digits: int) -> None:
    if num_examples < 1:
        raise ValueError(f"num_examples={num_examples!r} is invalid: allowed >= 1")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(
            f"min_digits={min_digits!r}, max_digits={max_digits!r} are invalid: need 1 <= min_digits <= max_digits"
        )


def _number(rng: random.Random, min_digits: int, max_digits: int) -> int:
    """A number of a uniformly drawn digit count in [min_digits, max_digits], without leading zeros."""
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def arithmetic_dataset(
    num_examples: int,
    *,
    min_digits: int = 1,
    max_digits: int = 2,
    operations: Sequence[str] = ARITHMETIC_OPERATIONS,
    seed: int = 0,
) -> datasets.Dataset:
    """``num_examples`` rows ``prompt`` = ``"12+7="``, ``answer`` = ``"19"`` (the exact integer result).

    Each operand has a digit count drawn uniformly from ``[min_digits, max_digits]``; the operation is drawn
    uniformly from ``operations`` (a subset of ``+ - *``; results of ``-`` may be negative). The same arguments
    give the same rows.

    Raises:
        ValueError: ``num_examples < 1``, ``not 1 <= min_digits <= max_digits``, or an empty or unknown operation.
    """
    import datasets

    _check_common(num_examples, min_digits, max_digits)
    if not operations or any(op not in ARITHMETIC_OPERATIONS for op in operations):
        raise ValueError(f"operations={tuple(operations)!r} is invalid: allowed a non-empty subset of + - *")
    rng = random.Random(seed)
    prompts: list[str] = []
    answers: list[str] = []
    for _ in range(num_examples):
        a, b = _number(rng, min_digits, max_digits), _number(rng, min_digits, max_digits)
        op = rng.choice(list(operations))
        result = a + b if op == "+" else a - b if op == "-" else a * b
        prompts.append(f"{a}{op}{b}=")
        answers.append(str(result))
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": answers})


def _solvable_target(rng: random.Random, numbers: list[int]) -> tuple[int, str]:
    """A positive integer reachable from all ``numbers`` (combined in a random order), and the expression."""
    for _ in range(100):
        order = rng.sample(numbers, len(numbers))
        value, text = Fraction(order[0]), str(order[0])
        for n in order[1:]:
            op = rng.choice("+-*/")
            if op == "/" and (n == 0 or (value / n).denominator != 1):
                op = "+"
            value = value + n if op == "+" else value - n if op == "-" else value * n if op == "*" else value / n
            text = f"({text} {op} {n})"
        if value.denominator == 1 and value >= 1:
            return int(value), text[1:-1] if text.startswith("(") else text
    total = sum(numbers)  # always reachable; only needed for degenerate numbers such as all zeros
    return total, " + ".join(str(n) for n in numbers)


def countdown_dataset(
    num_examples: int,
    *,
    num_numbers: int = 3,
    min_digits: int = 1,
    max_digits: int = 2,
    seed: int = 0,
) -> datasets.Dataset:
    """``num_examples`` countdown puzzles: reach ``target`` from ``numbers`` with ``+ - * /``, each number at most once.

    Columns: ``prompt`` (the instruction, asking for the expression inside ``<answer> </answer>``), ``numbers``
    (``num_numbers`` ints, each with ``min_digits`` to ``max_digits`` digits), ``target`` (a positive int reachable
    by combining all of them) and ``solution`` (one such expression). The same arguments give the same rows.
    Score completions with :func:`rlsdk.rewards.countdown_reward`.

    Raises:
        ValueError: ``num_examples < 1``, ``not 1 <= min_digits <= max_digits``, or ``num_numbers`` not in [2, 6].
    """
    import datasets

    _check_common(num_examples, min_digits, max_digits)
    if not 2 <= num_numbers <= 6:
        raise ValueError(f"num_numbers={num_numbers!r} is invalid: allowed an int in [2, 6]")
    rng = random.Random(seed)
    rows: dict[str, list[object]] = {"prompt": [], "numbers": [], "target": [], "solution": []}
    for _ in range(num_examples):
        numbers = [_number(rng, min_digits, max_digits) for _ in range(num_numbers)]
        target, solution = _solvable_target(rng, numbers)
        rows["prompt"].append(COUNTDOWN_PROMPT.format(numbers=numbers, target=target))
        rows["numbers"].append(numbers)
        rows["target"].append(target)
        rows["solution"].append(solution)
    return datasets.Dataset.from_dict(rows)
