"""Length shaping: DAPO's soft overlong punishment."""

from __future__ import annotations

from typing import Any

from rlsdk.rewards.apply import RewardFn


def length_penalty(max_length: int, buffer_length: int, *, penalty: float = 1.0, tokenizer: Any = None) -> RewardFn:
    """A reward function that is 0 up to ``max_length - buffer_length``, then falls linearly to ``-penalty``.

    This is the "soft overlong punishment" of DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
    Learning System at Scale", arXiv:2503.14476, overlong reward shaping), with ``L_max = max_length`` and
    ``L_cache = buffer_length``::

        0                                          if n <= max_length - buffer_length
        -penalty * (n - (max_length - buffer_length)) / buffer_length   if n <= max_length
        -penalty                                   otherwise

    It is meant to be added to a correctness reward (see :func:`~rlsdk.rewards.combine.combine_rewards`, weight
    1.0 reproduces DAPO). DAPO sets ``max_length`` to the generation limit (``rollout.max_new_tokens``) so that
    long answers are discouraged before they are truncated.

    Args:
        max_length: ``L_max``, >= 1, in tokens when ``tokenizer`` is given, else in characters.
        buffer_length: ``L_cache``, the width of the linear zone, in [1, max_length].
        penalty: The value subtracted at and beyond ``max_length``, >= 0.
        tokenizer: Count tokens with it (``len(tokenizer(c, add_special_tokens=False)["input_ids"])``; the
            decoded completion re-tokenised, usually the sampled count); ``None`` counts characters.

    Raises:
        ValueError: an argument outside the ranges above.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"length_penalty max_length={max_length!r} is invalid: allowed an int >= 1")
    if isinstance(buffer_length, bool) or not isinstance(buffer_length, int) or not 1 <= buffer_length <= max_length:
        raise ValueError(
            f"length_penalty buffer_length={buffer_length!r} is invalid: allowed an int in [1, max_length={max_length}]"
        )
    if not penalty >= 0:
        raise ValueError(f"length_penalty penalty={penalty!r} is invalid: allowed a float >= 0")
    start = max_length - buffer_length

    def measure(completions: list[str]) -> list[int]:
        if tokenizer is None:
            return [len(c) for c in completions]
        return [len(ids) for ids in tokenizer(list(completions), add_special_tokens=False)["input_ids"]]

    def length_penalty_reward(completions: list[str], **_: Any) -> list[float]:
        return [0.0 if n <= start else -penalty * min((n - start) / buffer_length, 1.0) for n in measure(completions)]

    unit = "characters" if tokenizer is None else "tokens"
    length_penalty_reward.__qualname__ = f"length_penalty({max_length}, {buffer_length} {unit}, penalty={penalty:g})"
    return length_penalty_reward
