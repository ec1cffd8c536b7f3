"""``policy_loss`` driven by an options dict: the option-grid tests and the reference-fixture tests share it."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from rlsdk.algorithms import policy_loss


def policy_loss_with_options(
    logprobs_B_C: torch.Tensor,
    old_B_C: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_C: torch.Tensor,
    opts: dict[str, Any],
    **tensors: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``policy_loss`` with the scalar options in ``opts`` (``clip_eps_low``, ``clip_eps_high``, ``loss_agg``,
    ``ratio_level``, ``kl_coef``, ``kl_estimator``, ``entropy_coef``, ``is_cap``, ``is_cap_mode``) and the
    optional tensors and normalisers in ``tensors``; asserts that it warns about k1 exactly when k1 is a loss
    term (``kl_coef > 0``)."""
    names = ("clip_eps_low", "clip_eps_high", "loss_agg", "ratio_level", "kl_coef", "kl_estimator", "entropy_coef",
             "is_cap", "is_cap_mode")  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = policy_loss(logprobs_B_C, old_B_C, advantages_B, mask_B_C, **{k: opts[k] for k in names}, **tensors)
    k1_warnings = [w for w in caught if "penalises nothing" in str(w.message)]
    assert len(k1_warnings) == (opts["kl_coef"] > 0 and opts["kl_estimator"] == "k1"), [str(w.message) for w in caught]
    return result
