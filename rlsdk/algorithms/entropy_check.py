"""Is the entropy bonus larger than the policy-gradient signal? A check for the first updates of a run.

The loss of a step is ``policy_loss - entropy_coef * H`` (``H``: mean token entropy, at most ``log V`` for a
vocabulary of ``V`` tokens; a randomly initialised policy starts near that maximum). The policy-gradient term's
per-token scale is the advantage ``|A|`` (about 1 with std-scaled GRPO advantages, the reward spread without
scaling). When ``entropy_coef * H`` exceeds the mean ``|A|``, the bonus, not the reward, decides the first
updates: a coefficient tuned on a 16-token vocabulary (``log V`` = 2.8) weighs four times as much on a 152k one
(``log V`` = 11.9). The Session warns once, at the first update whose advantages are not all zero.
"""

from __future__ import annotations

import math

import torch


def entropy_bonus_ratio(entropy_coef: float, entropy_mean: float, advantages_B: torch.Tensor) -> float:
    """``entropy_coef * entropy_mean / mean(|advantages_B|)``: above 1 the bonus outweighs the policy-gradient
    signal. ``inf`` when every advantage is 0 (nothing to compare with), 0 when ``entropy_coef`` is 0."""
    if entropy_coef == 0:
        return 0.0
    scale = float(advantages_B.abs().mean()) if advantages_B.numel() else 0.0
    return math.inf if scale == 0 else entropy_coef * entropy_mean / scale


def suggested_entropy_coef(advantages_B: torch.Tensor, entropy_mean: float, share: float = 0.1) -> float:
    """The coefficient at which the bonus is ``share`` of the mean ``|A|`` at this entropy."""
    return share * float(advantages_B.abs().mean()) / max(entropy_mean, 1e-12)
