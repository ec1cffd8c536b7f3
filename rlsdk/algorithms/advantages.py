"""Advantage estimators. Shapes: ``B`` = samples in the batch, ``G`` = groups, ``S`` = samples per group."""

from __future__ import annotations

from typing import Literal

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
    rewards_B = _check_rewards(rewards_B, group_size)
    rewards_G_S = rewards_B.view(-1, group_size)
    centred_G_S = rewards_G_S - rewards_G_S.mean(dim=1, keepdim=True)
    if scale_by_std:
        std_G_1 = rewards_G_S.std(dim=1, unbiased=False, keepdim=True)
        centred_G_S = centred_G_S / (std_G_1 + eps)
    return centred_G_S.reshape(-1)


def _check_rewards(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """Shape-check ``rewards_B`` against ``group_size``; returns it as a float tensor."""
    if group_size < 1:
        raise ValueError(f"group_size={group_size!r} is invalid: allowed >= 1")
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards_B must be 1-D [B], got shape {tuple(rewards_B.shape)}")
    if rewards_B.shape[0] % group_size:
        raise ValueError(f"rewards_B has {rewards_B.shape[0]} samples, not a multiple of group_size={group_size}")
    return rewards_B if rewards_B.is_floating_point() else rewards_B.float()


def rloo_advantages(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO leave-one-out advantages (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019).

    Each sample's baseline is the mean reward of the OTHER ``S - 1`` samples of its group::

        A_i = r_i - 1/(S-1) * sum_{j != i} r_j  =  S/(S-1) * (r_i - mean_group)

    No division by a standard deviation. A group whose rewards are all equal gets advantage 0.

    Args:
        rewards_B: float rewards, shape ``[B]`` with ``B = G * group_size``, each group contiguous.
        group_size: samples per prompt, >= 2 (a lone sample has no leave-one-out baseline).

    Returns:
        ``advantages_B``: shape ``[B]``, the dtype of ``rewards_B`` (float32 for integer rewards).

    Raises:
        ValueError: ``rewards_B`` is not 1-D, ``group_size < 2``, or ``B`` is not a multiple of ``group_size``.
    """
    rewards_B = _check_rewards(rewards_B, group_size)
    if group_size < 2:
        raise ValueError(f"group_size={group_size!r} is invalid for RLOO: allowed >= 2 (leave-one-out baseline)")
    rewards_G_S = rewards_B.view(-1, group_size)
    baseline_G_S = (rewards_G_S.sum(dim=1, keepdim=True) - rewards_G_S) / (group_size - 1)
    return (rewards_G_S - baseline_G_S).reshape(-1)


def reinforce_pp_advantages(
    rewards_B: torch.Tensor, group_size: int, *, group_baseline: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++ advantages for outcome rewards (Hu 2025, arXiv 2501.03262): batch-level normalisation.

    Without ``group_baseline`` (REINFORCE++)::

        A_i = (r_i - mean_batch(r)) / (std_batch(r) + eps)

    With ``group_baseline`` ("REINFORCE++-baseline", OpenRLHF's ``reinforce_baseline``): subtract the group
    mean first, then normalise over the whole batch::

        c_i = r_i - mean_group(r);   A_i = (c_i - mean_batch(c)) / (std_batch(c) + eps)

    ``mean_batch``/``std_batch`` run over every sample of ``rewards_B`` (so call this on the GLOBAL batch, as
    the Session does), with the population std. Departures from the paper: the paper's advantage is
    token-level, ``r - beta * sum_{s >= t} KL_s``, with the KL penalty folded into the return; here the KL
    penalty stays in the loss (``kl_coef``), so the advantage is one value per sequence. OpenRLHF normalises
    over completion TOKENS (each sequence weighted by its length); here each sequence weighs 1.

    Args:
        rewards_B: float rewards, shape ``[B]`` with ``B = G * group_size``, each group contiguous.
        group_size: samples per prompt, >= 1 (only used with ``group_baseline``, but always shape-checked).
        group_baseline: subtract the group mean before the batch normalisation.
        eps: added to the batch std before dividing (units of reward), > 0.

    Returns:
        ``advantages_B``: shape ``[B]``, the dtype of ``rewards_B`` (float32 for integer rewards). All-zero
        when every reward (or every group-centred reward) in the batch is equal.

    Raises:
        ValueError: ``rewards_B`` is not 1-D, ``group_size < 1``, or ``B`` is not a multiple of ``group_size``.
    """
    rewards_B = _check_rewards(rewards_B, group_size)
    centred_B = rewards_B
    if group_baseline:
        rewards_G_S = rewards_B.view(-1, group_size)
        centred_B = (rewards_G_S - rewards_G_S.mean(dim=1, keepdim=True)).reshape(-1)
    centred_B = centred_B - centred_B.mean()
    return centred_B / (centred_B.std(unbiased=False) + eps)


AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]


def compute_advantages(
    rewards_B: torch.Tensor,
    group_size: int,
    estimator: AdvantageEstimator,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Dispatch to one estimator by name; ``rewards_B`` is the GLOBAL batch, groups contiguous.

    'grpo': :func:`group_advantages` with ``scale_by_std``; 'dr_grpo': :func:`group_advantages` without the
    std (``scale_by_std`` is not read); 'rloo': :func:`rloo_advantages`; 'reinforce_pp' and
    'reinforce_pp_baseline': :func:`reinforce_pp_advantages` without / with the group baseline. ``eps`` goes
    to the estimators that divide by a std.

    Raises:
        ValueError: an unknown ``estimator``, or the chosen estimator's own shape/``group_size`` errors.
    """
    if estimator == "grpo":
        return group_advantages(rewards_B, group_size, scale_by_std=scale_by_std, eps=eps)
    if estimator == "dr_grpo":
        return group_advantages(rewards_B, group_size, scale_by_std=False, eps=eps)
    if estimator == "rloo":
        return rloo_advantages(rewards_B, group_size)
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        return reinforce_pp_advantages(
            rewards_B, group_size, group_baseline=estimator == "reinforce_pp_baseline", eps=eps
        )
    raise ValueError(
        f"estimator={estimator!r} is invalid: allowed 'grpo', 'dr_grpo', 'rloo', 'reinforce_pp', "
        "'reinforce_pp_baseline'"
    )
