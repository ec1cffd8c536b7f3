"""Reward functions: batched, ``fn(completions, **columns) -> list[float]`` (sync or async).

Built-ins: :func:`reverse_reward`, :func:`math_reward` (the ``math`` extra), :func:`countdown_reward`; factories
that return a reward function: :func:`exact_match`, :func:`format_match`, :func:`length_penalty`, and
:func:`combine_rewards` for weighted sums that keep each component for logging.
"""

from rlsdk.rewards.apply import RewardError, RewardFn, compute_reward_breakdown, compute_rewards
from rlsdk.rewards.combine import RewardBreakdown, RewardComponentError, combine_rewards
from rlsdk.rewards.countdown import check_countdown, countdown_reward, extract_expression
from rlsdk.rewards.length import length_penalty
from rlsdk.rewards.match import exact_match, format_match
from rlsdk.rewards.math_answer import math_reward
from rlsdk.rewards.reverse import PARTIAL_CREDIT_WEIGHT, reverse_reward

__all__ = [
    "PARTIAL_CREDIT_WEIGHT",
    "RewardBreakdown",
    "RewardComponentError",
    "RewardError",
    "RewardFn",
    "check_countdown",
    "combine_rewards",
    "compute_reward_breakdown",
    "compute_rewards",
    "countdown_reward",
    "exact_match",
    "extract_expression",
    "format_match",
    "length_penalty",
    "math_reward",
    "reverse_reward",
]
