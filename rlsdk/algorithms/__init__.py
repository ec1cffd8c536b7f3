"""Advantage estimators, token log-probabilities, policy losses and the SFT loss: pure tensor functions."""

from rlsdk.algorithms.advantages import (
    compute_advantages,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rlsdk.algorithms.logprobs import completion_logprobs, token_entropy, token_logprobs
from rlsdk.algorithms.losses import grpo_loss, kl_penalty, policy_loss
from rlsdk.algorithms.sft import sft_loss

__all__ = [
    "completion_logprobs",
    "compute_advantages",
    "group_advantages",
    "grpo_loss",
    "kl_penalty",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sft_loss",
    "token_entropy",
    "token_logprobs",
]
