"""Reward for the countdown task (:func:`rlsdk.data.tasks.countdown_dataset`), checked without ``eval``.

The expression is parsed with :mod:`ast` and walked by hand: only non-negative integer literals, ``+ - * /`` and
parentheses are accepted, so a completion can never run code. Arithmetic is exact (:class:`fractions.Fraction`).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

MAX_EXPRESSION_CHARS = 256
"""Longer expressions earn 0 without being parsed (bounds the parser's work and nesting depth)."""

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class _Rejected(Exception):
    """The expression uses something other than integer literals and + - * /."""


def extract_expression(completion: str) -> str:
    """The expression a completion proposes: the last ``<answer>...</answer>`` if any, else its last non-empty
    line; anything from the first ``=`` on is dropped (``"25+21=46"`` -> ``"25+21"``)."""
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        text = tagged[-1]
    else:
        lines = [line for line in completion.splitlines() if line.strip()]
        text = lines[-1] if lines else ""
    return text.split("=", 1)[0].strip()


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise _Rejected("division by zero")
        return left / right
    raise _Rejected(f"{type(node).__name__} is not allowed")


def check_countdown(expression: str, numbers: Sequence[int], target: int) -> bool:
    """Whether ``expression`` uses only ``numbers`` (each at most as often as it appears there), integer
    literals, ``+ - * /`` and parentheses, and evaluates exactly to ``target``. Never executes the text."""
    if not expression or len(expression) > MAX_EXPRESSION_CHARS:
        return False
    try:
        tree = ast.parse(expression, mode="eval")
        used: list[int] = []
        value = _evaluate(tree, used)
    except (SyntaxError, ValueError, RecursionError, MemoryError, _Rejected):
        return False
    if Counter(used) - Counter(int(n) for n in numbers):  # a number not offered, or used too often
        return False
    return value == target


def countdown_reward(completions: list[str], numbers: list[Sequence[int]], target: list[int], **_: Any) -> list[float]:
    """1.0 where the completion's expression (see :func:`extract_expression`) reaches ``target`` using each of
    ``numbers`` at most once (see :func:`check_countdown`), else 0.0.

    Args:
        completions: decoded completions, one per sample.
        numbers: the numbers offered per sample (the data set's ``numbers`` column).
        target: the target per sample (the data set's ``target`` column).

    Raises:
        ValueError: the three lists differ in length.
    """
    if not len(completions) == len(numbers) == len(target):
        raise ValueError(
            f"completions has {len(completions)} items, numbers {len(numbers)} and target {len(target)}; "
            "they must be equal"
        )
    return [float(check_countdown(extract_expression(c), n, int(t))) for c, n, t in zip(completions, numbers, target)]
