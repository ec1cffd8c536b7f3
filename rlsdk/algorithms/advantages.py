"""Advantage estimators. Shapes: ``B`` = samples in the batch, ``G`` = groups, ``S`` = samples per group.

Exactness of constant groups. A group whose rewards are all equal carries no preference between its samples, so
every estimator here gives each of its samples an advantage of exactly 0 (``reinforce_pp`` without a group
baseline: a batch whose rewards are all equal). Plain float32 arithmetic does not: the mean of sixteen 0.7s is off
by one ulp, the std is ~1e-8, far below ``eps``, and ``(r - mean) / (std + eps)`` gives every sample +0.056, the
same push for the whole group. Two measures, each principled on its own:

1. Statistics are computed in float64 and the result is rounded back to the rewards' dtype once. For float32
   (and bf16/fp16) rewards this is exact where it matters: ``S`` copies of a float32 value sum exactly in float64
   and the division by ``S`` is correctly rounded, so ``r - mean`` is exactly 0 for a constant group; for
   near-constant groups the centred values keep their true signs and sizes instead of float32 rounding noise.
   Non-constant groups change by rounding only (the float64 value rounded once, instead of several float32
   roundings).
2. A group whose largest and smallest rewards are equal (compared exactly, ``max == min``) is set to 0
   explicitly. This covers what (1) cannot: float64 rewards (no wider type to compute in) and the batch-level
   normalisation of ``reinforce_pp_baseline``, whose batch mean of group-centred values is 0 in exact arithmetic
   but not in floating point. verl and TRL get close to this by adding ``eps`` to a tiny std; they do not make
   the advantage exactly 0.
"""

from __future__ import annotations

from typing import Literal

import torch

# The dtype statistics are computed in (see the module docstring).
_STATS_DTYPE = torch.float64


def _constant_rows(values_G_S: torch.Tensor) -> torch.Tensor:
    """``[G, 1]`` bool: True for rows whose values are all equal (compared exactly, no tolerance)."""
    return values_G_S.amax(dim=1, keepdim=True) == values_G_S.amin(dim=1, keepdim=True)


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
    whose rewards are all equal gets advantage exactly 0 for every sample, in every dtype (see the module
    docstring: statistics in float64, and ``max == min`` groups zeroed).

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
    rewards_G_S = rewards_B.view(-1, group_size).to(_STATS_DTYPE)
    centred_G_S = rewards_G_S - rewards_G_S.mean(dim=1, keepdim=True)
    if scale_by_std:
        std_G_1 = rewards_G_S.std(dim=1, unbiased=False, keepdim=True)
        centred_G_S = centred_G_S / (std_G_1 + eps)
    centred_G_S = torch.where(_constant_rows(rewards_G_S), 0.0, centred_G_S)
    return centred_G_S.reshape(-1).to(rewards_B.dtype)


def check_group_rewards(rewards_B: torch.Tensor, group_size: int) -> None:
    """Raise ValueError unless ``rewards_B`` is 1-D ``[B]`` with ``B`` a multiple of ``group_size >= 1`` (groups of
    ``group_size`` consecutive samples)."""
    if group_size < 1:
        raise ValueError(f"group_size={group_size!r} is invalid: allowed >= 1")
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards_B must be 1-D [B], got shape {tuple(rewards_B.shape)}")
    if rewards_B.shape[0] % group_size:
        raise ValueError(f"rewards_B has {rewards_B.shape[0]} samples, not a multiple of group_size={group_size}")


def _check_rewards(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """Shape-check ``rewards_B`` against ``group_size``; returns it as a float tensor."""
    check_group_rewards(rewards_B, group_size)
    return rewards_B if rewards_B.is_floating_point() else rewards_B.float()


def rloo_advantages(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO leave-one-out advantages (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019).

    Each sample's baseline is the mean reward of the OTHER ``S - 1`` samples of its group::

        A_i = r_i - 1/(S-1) * sum_{j != i} r_j  =  S/(S-1) * (r_i - mean_group)

    No division by a standard deviation. A group whose rewards are all equal gets advantage exactly 0 (computed
    as ``S/(S-1) * (r_i - mean_group)`` in float64, ``max == min`` groups zeroed: see the module docstring).

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
    rewards_G_S = rewards_B.view(-1, group_size).to(_STATS_DTYPE)
    # r_i - (sum - r_i) / (S - 1), rearranged so that a constant group cancels exactly before any scaling.
    advantages_G_S = (rewards_G_S - rewards_G_S.mean(dim=1, keepdim=True)) * (group_size / (group_size - 1))
    advantages_G_S = torch.where(_constant_rows(rewards_G_S), 0.0, advantages_G_S)
    return advantages_G_S.reshape(-1).to(rewards_B.dtype)


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
        ``advantages_B``: shape ``[B]``, the dtype of ``rewards_B`` (float32 for integer rewards). Exactly 0
        for every sample when every reward in the batch is equal; with ``group_baseline``, exactly 0 for every
        sample of a group whose rewards are all equal (its centred rewards are 0, and so is the batch mean of
        the centred rewards in exact arithmetic). See the module docstring.

    Raises:
        ValueError: ``rewards_B`` is not 1-D, ``group_size < 1``, or ``B`` is not a multiple of ``group_size``.
    """
    rewards_B = _check_rewards(rewards_B, group_size)
    rewards_G_S = rewards_B.view(-1, group_size).to(_STATS_DTYPE)
    if group_baseline:
        rewards_G_S = rewards_G_S - rewards_G_S.mean(dim=1, keepdim=True)
        constant_G_1 = _constant_rows(rewards_B.view(-1, group_size))
    else:
        constant_G_1 = _constant_rows(rewards_B.view(1, -1))
    centred_G_S = rewards_G_S - rewards_G_S.mean()
    advantages_G_S = centred_G_S / (centred_G_S.std(unbiased=False) + eps)
    advantages_G_S = torch.where(constant_G_1, 0.0, advantages_G_S)
    return advantages_G_S.reshape(-1).to(rewards_B.dtype)


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
