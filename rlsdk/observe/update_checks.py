"""Warnings an RL update raises from its own statistics: a trainer that disagrees with the engine's behaviour
log-probabilities, and an entropy bonus that outweighs the reward signal (see
:mod:`rlsdk.algorithms.entropy_check`). Each logs through the project logger; nothing is raised."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from rlsdk.algorithms.entropy_check import entropy_bonus_ratio, suggested_entropy_coef
from rlsdk.observe.logging import get_logger

logger = get_logger("rlsdk.session")  # the Session's own warnings, under its logger name as before


def warn_on_disagreement(
    stats: Mapping[str, float],
    *,
    step: int,
    threshold: float,
    compared_version: int,
    served_dtype: str,
    trained_dtype: str,
) -> bool:
    """Warn when the update's mean |trainer - engine| log-probability (``stats['agreement/...']``, see
    :func:`rlsdk.observe.rollout_metrics.update_metrics`) exceeds ``threshold``
    (``inference.logprob_warn_threshold``); returns whether it warned.

    The metrics cover only the rows ``compared_version`` (the weights the trainer held) sampled wholly
    (``agreement/tokens`` of them): a mean of NaN, no such row, is nothing to judge and never warns."""
    mean = stats["agreement/logprob_absdiff_mean"]
    if not mean > threshold:  # NaN included
        return False
    logger.warning(
        "update %d: trainer and engine disagree: mean |logprob diff| %.4g (max %.4g, ratio in "
        "[%.3f, %.3f]) > inference.logprob_warn_threshold=%g over the %d tokens of rows sampled wholly by the "
        "trainer's v%d (engine serves %s, trainer computes in %s); corrupted engine weights, a dtype mismatch, or "
        "top-k/top-p sampling?",
        step,
        mean,
        stats["agreement/logprob_absdiff_max"],
        stats["agreement/ratio_min"],
        stats["agreement/ratio_max"],
        threshold,
        int(stats["agreement/tokens"]),
        compared_version,
        served_dtype,
        trained_dtype,
    )
    return True


def check_entropy_bonus(
    entropy_coef: float, entropy_mean: float, advantages_B: torch.Tensor, *, vocab: int, step: int
) -> bool:
    """Warn when ``entropy_coef`` x the batch's mean token entropy exceeds its mean |advantage|. Returns whether
    the check was decided (False: the coefficient is 0 or every advantage is 0, so a later update checks again)."""
    if entropy_coef == 0:
        return False
    ratio = entropy_bonus_ratio(entropy_coef, entropy_mean, advantages_B)
    if math.isinf(ratio):
        return False  # no signal yet to compare with
    if ratio > 1.0:
        logger.warning(
            "algorithm.entropy_coef=%g x mean token entropy %.3g nats (log V = %.3g for a vocabulary of %d) is "
            "%.1fx the mean |advantage| %.3g of update %d: the entropy bonus, not the reward, drives the first "
            "updates (a coefficient tuned on a small vocabulary weighs log V times more on a large one). "
            "Consider entropy_coef <= %.2g (a tenth of the advantage scale) or 0; see docs/howto/algorithms.md",
            entropy_coef,
            entropy_mean,
            math.log(vocab) if vocab > 1 else float("nan"),
            vocab,
            ratio,
            float(advantages_B.abs().mean()),
            step,
            suggested_entropy_coef(advantages_B, entropy_mean),
        )
    return True


def warn_after_update(
    stats: Mapping[str, float],
    advantages_B: torch.Tensor,
    config: Any,
    *,
    vocab: int,
    checked: bool,
) -> bool:
    """An update's warnings from its ``stats`` (:func:`~rlsdk.observe.update_stats.update_step_metrics`): the
    entropy bonus once (unless ``checked``), at the first update with a signal; the trainer/engine disagreement
    at every update past the threshold; and a note of the stale samples dropped, if any. Returns whether the
    entropy check is decided now (pass it back as ``checked``)."""
    step, trainer_version = int(stats["step"]), int(stats["version/trainer"])
    if not checked:
        checked = check_entropy_bonus(
            config.algorithm.entropy_coef, stats["train/entropy"], advantages_B, vocab=vocab, step=step
        )
    warn_on_disagreement(
        stats,
        step=step,
        threshold=config.inference.logprob_warn_threshold,
        compared_version=trainer_version - 1,  # the weights the update started from
        served_dtype=config.inference.dtype or config.model.dtype,
        trained_dtype="bf16 (float32 master weights)" if config.train.mixed_precision == "bf16" else config.model.dtype,
    )
    return checked
