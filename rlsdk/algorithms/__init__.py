"""Advantage estimators, token log-probabilities and policy losses: pure tensor functions."""

from rlsdk.algorithms.advantages import group_advantages
from rlsdk.algorithms.logprobs import completion_logprobs, token_entropy, token_logprobs
from rlsdk.algorithms.losses import grpo_loss

__all__ = ["completion_logprobs", "group_advantages", "grpo_loss", "token_entropy", "token_logprobs"]
