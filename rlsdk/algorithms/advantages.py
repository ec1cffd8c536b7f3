"""Advantage estimators. Shapes: ``B`` = samples in the batch, ``G`` = groups, ``S`` = samples per group."""

from __future__ import annotations

import torch


def group_advantages(
    rewards_B: torch.Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO group-relative advantages (DeepSeekMath, Shao et al. 2024, outcome supervision).

    The ``group_size`` samples of one prompt are contiguous: ``rewards_B.view(G, group_size)``. With
    ``scale_by_std``: ``A = (r - mean_group) / (std_group + eps)``; without: ``A = r - mean_group`` (the
    "Dr. GRPO" variant, Liu et al. 2025, which drops the std division's difficulty bias).

    ``std_group`` is the population standard deviation (``unbiased=False``): it is defined for ``group_size``
    1 (a lone sample gets advantage 0) and never divides by ``group_size - 1``. TRL and the GRPO reference
    code use the unbiased estimator; the two differ by a factor ``sqrt(S / (S - 1))`` (3% at S = 16). A group
    whose rewards are all equal gets advantage 0 for every sample.

    Args:
        rewards_B: float rewards, shape ``[B]`` with ``B = G * group_size``.
        group_size: samples per prompt, >= 1.
        scale_by_std: divide by the group's standard deviation.
        eps: added to the std before dividing (units of reward).

    Returns:
        ``advantages_B``: shape ``[B]``, the dtype of ``rewards_B`` (float32 for integer rewards).

    Raises:
        ValueError: ``rewards_B`` is not 1-D, ``group_size < 1``, or ``B`` is not a multiple of
            ``group_size``.
    """
    if group_size < 1:
        raise ValueError(f"group_size={group_size!r} is invalid: allowed >= 1")
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards_B must be 1-D [B], got shape {tuple(rewards_B.shape)}")
    if rewards_B.shape[0] % group_size:
        raise ValueError(f"rewards_B has {rewards_B.shape[0]} samples, not a multiple of group_size={group_size}")
    if not rewards_B.is_floating_point():
        rewards_B = rewards_B.float()
    rewards_G_S = rewards_B.view(-1, group_size)
    centred_G_S = rewards_G_S - rewards_G_S.mean(dim=1, keepdim=True)
    if scale_by_std:
        std_G_1 = rewards_G_S.std(dim=1, unbiased=False, keepdim=True)
        centred_G_S = centred_G_S / (std_G_1 + eps)
    return centred_G_S.reshape(-1)
