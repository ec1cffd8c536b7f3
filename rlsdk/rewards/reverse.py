"""Reward for the reverse-digits task (:mod:`rlsdk.data.reverse`)."""

from __future__ import annotations

from typing import Any

PARTIAL_CREDIT_WEIGHT = 0.5
"""Scale of the per-position partial credit; an inexact answer earns at most this much (strictly less)."""


def reverse_reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """1.0 for an exact answer, else ``PARTIAL_CREDIT_WEIGHT`` x the fraction of positions right.

    ``completion`` is the decoded completion with the EOS token removed (and surrounding whitespace stripped).
    The fraction is ``#{i : completion[i] == answer[i]} / max(len(answer), len(completion))``, so extra or
    missing characters cost credit and an inexact answer earns strictly less than ``PARTIAL_CREDIT_WEIGHT``
    (0.5). A mean reward >= 0.9 therefore needs >= 80% exact answers: it means the task is solved.

    Why partial credit: from random initialisation an exact 3-digit answer has probability ~1e-4 per sample
    (16-token vocabulary), so exact-match-only rewards give almost every GRPO group zero variance and no
    signal; partial credit gives every group a gradient from the first step (``benchmarks/bare_grpo.py``
    compares the two).

    Args:
        completions: decoded completions, one per sample.
        answer: the reference answer for each sample (the data set's ``answer`` column, repeated per sample).

    Returns:
        One float in ``[0, 1]`` per completion.

    Raises:
        ValueError: ``completions`` and ``answer`` differ in length.
    """
    if len(completions) != len(answer):
        raise ValueError(f"completions has {len(completions)} items but answer has {len(answer)}")
    rewards: list[float] = []
    for completion, reference in zip(completions, answer):
        text = completion.strip()
        if text == reference:
            rewards.append(1.0)
            continue
        longest = max(len(text), len(reference))
        if longest == 0:
            rewards.append(0.0)
            continue
        right = sum(a == b for a, b in zip(text, reference))
        rewards.append(PARTIAL_CREDIT_WEIGHT * right / longest)
    return rewards
