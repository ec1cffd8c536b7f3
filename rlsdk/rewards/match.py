"""String rewards: exact match against a reference column, and a regular-expression format check."""

from __future__ import annotations

import re
from typing import Any

from rlsdk.rewards.apply import RewardFn


def exact_match(*, column: str = "answer", strip: bool = True, ignore_case: bool = False) -> RewardFn:
    """A reward function: 1.0 where the completion equals the reference in ``column``, else 0.0.

    Args:
        column: The prompt-row column holding the reference answer (converted with ``str``), e.g. ``answer``.
        strip: Compare without surrounding whitespace (both sides).
        ignore_case: Compare case-insensitively (``str.casefold``).

    The returned function raises ``ValueError`` when ``column`` is missing from the rows (the message lists the
    columns it got) or its length differs from ``completions``.
    """

    def normalise(text: str) -> str:
        text = text.strip() if strip else text
        return text.casefold() if ignore_case else text

    def exact_match_reward(completions: list[str], **columns: Any) -> list[float]:
        if column not in columns:
            raise ValueError(f"exact_match needs the column {column!r}; the rows have {sorted(columns)}")
        references = columns[column]
        if len(references) != len(completions):
            raise ValueError(f"completions has {len(completions)} items but {column} has {len(references)}")
        return [float(normalise(c) == normalise(str(r))) for c, r in zip(completions, references)]

    exact_match_reward.__qualname__ = f"exact_match(column={column!r}, strip={strip}, ignore_case={ignore_case})"
    return exact_match_reward


def format_match(pattern: str, *, flags: int = 0, full: bool = False) -> RewardFn:
    """A reward function: 1.0 where the completion matches the regular expression ``pattern``, else 0.0.

    ``full=False`` searches anywhere in the completion (``re.search``); ``full=True`` needs the whole completion
    to match (``re.fullmatch``). ``flags`` are ``re`` flags, e.g. ``re.DOTALL`` for multi-line reasoning blocks.
    Typical use, weighted low next to a correctness reward::

        format_match(r"<think>.*</think>\\s*<answer>.*</answer>", flags=re.DOTALL, full=True)

    Raises:
        ValueError: ``pattern`` does not compile (the message has the ``re`` error).
    """
    try:
        compiled = re.compile(pattern, flags)
    except re.error as exc:
        raise ValueError(f"format_match pattern {pattern!r} does not compile: {exc}") from exc
    match = compiled.fullmatch if full else compiled.search

    def format_reward(completions: list[str], **_: Any) -> list[float]:
        return [float(match(completion) is not None) for completion in completions]

    format_reward.__qualname__ = f"format_match({pattern!r}, full={full})"
    return format_reward
