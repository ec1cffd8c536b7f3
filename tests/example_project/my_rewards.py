"""A user's reward: 1.0 for a completion that is exactly the answer, else 0.0."""

from __future__ import annotations

from typing import Any


def exact_match(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]
