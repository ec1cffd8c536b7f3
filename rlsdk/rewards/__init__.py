"""Reward functions: batched, ``fn(completions, **columns) -> list[float]`` (sync or async)."""

from rlsdk.rewards.apply import RewardError, RewardFn, compute_rewards
from rlsdk.rewards.reverse import PARTIAL_CREDIT_WEIGHT, reverse_reward

__all__ = ["PARTIAL_CREDIT_WEIGHT", "RewardError", "RewardFn", "compute_rewards", "reverse_reward"]
