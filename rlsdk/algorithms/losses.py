"""Policy losses. Shape names: ``B`` = sequences, ``C`` = completion tokens (right-padded).

``policy_loss`` is the general PPO-style clipped surrogate with the options of the GRPO family (loss
aggregation, token- or sequence-level ratio, KL estimator, entropy bonus, off-policy corrections);
``grpo_loss`` is its original fixed configuration (token-level ratio, token mean, k3 KL). The per-token formula
is in ``policy_loss``'s docstring; the rest of its contract follows.

Importance weight. ``w_it`` is 1 without ``behaviour_logprobs_B_C``; with them, ``w_it = exp(old_it -
behaviour_it)`` corrects for sampling from the behaviour policy (the inference engine) rather than ``old`` (the
proximal policy, e.g. the trainer's recomputed logprobs): ``is_cap_mode='truncate'`` uses ``min(w, is_cap)``
(truncated importance sampling, Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training"); ``'mask'`` drops tokens with ``w > is_cap`` from the loss (decoupled PPO, Hilton et al. 2021, as
AReaL's ``behav_imp_weight_cap``, Fu et al. 2025).

Sequence-level ratio. GSPO's (Zheng et al. 2025) in its "GSPO-token" form: its value is ``s_i`` on every token and
clipping is decided per sequence; with ``loss_agg='seq_mean_token_mean'`` the loss and its gradient equal GSPO's
``-1/B sum_i min(s_i A_i, clip(s_i) A_i)``.

Aggregation (``m`` = mask, ``|y_i|`` = tokens of sequence ``i``)::

    token_mean           sum_it m l / num_tokens                               DAPO (Yu et al. 2025)
    seq_mean_token_mean  sum_i (sum_t m l / |y_i|) / num_sequences             GRPO (Shao et al. 2024)
    seq_sum_fixed_len    sum_it m l / (num_sequences * max_len)                Dr. GRPO (Liu et al. 2025)

Every normaliser is a GLOBAL-batch quantity: chunks of a batch (micro-batches, ranks) that each pass the whole
batch's ``num_tokens`` / ``num_sequences`` (and the same ``max_len``) sum to the whole-batch loss, so gradient
accumulation and data parallelism need no rescaling (with DDP, which averages gradients over ranks, pass the
global count divided by the world size). Defaults: ``num_tokens = max(mask.sum(), 1)``, ``num_sequences =
max(B, 1)`` (this batch is the whole batch); ``max_len`` has no default (Dr. GRPO's constant is the generation
limit, not this batch's padded width). A sequence with no masked token contributes 0 to ``seq_mean_token_mean``
but still counts in ``num_sequences`` (verl's default leaves it out). A batch with no masked token (``B = 0``
included) gives loss 0 under every aggregation, with zero gradients.

Gradients flow through ``logprobs_B_C`` (and ``entropy_B_C`` if it has a graph); ``old``, ``ref``, ``behaviour``
log-probs and ``advantages_B`` are treated as constants. Masked positions may hold any value, non-finite included.
``kl_estimator='k1'`` as a loss term has a zero expected gradient (derivation in docs/howto/algorithms.md).

Numerical guards (see docs/howto/algorithms.md, "Numerical guards"). Every ``exp`` of a log-ratio in the loss
would overflow float32 above ~88.7: the loss turns inf, or stays finite while its gradient turns NaN (``inf * 0``
in the backward of a clipped or dropped term). The guards, chosen so that nothing changes in the regime a
healthy run lives in:

- The PPO log-ratio (token-level, or GSPO's sequence-level one) is clamped to ``[-LOG_RATIO_LIMIT,
  LOG_RATIO_LIMIT]`` (20, as verl) before ``exp``. Inside, loss and gradient are exact. Beyond, the ratio holds
  at ``e^±20`` and the token carries no ratio gradient: for ``A > 0`` above the limit, and ``A < 0`` below it,
  PPO's clip already zeroes that gradient; for ``A > 0`` below the limit the exact gradient is ``< 2.1e-9 A``;
  only for ``A < 0`` above the limit does the guard remove a gradient, one larger than ``4.8e8 |A|`` that would
  swamp every other token of the batch (such a ratio means mismatched log-probs, not learning).
- The importance weight's log (``old - behaviour``) is clamped the same way (a constant: no gradient either way).
- k3 is continued linearly above ``log_r = LOG_RATIO_LIMIT`` (value and slope continuous there): its gradient
  keeps pulling the policy back toward the reference, with a bounded slope ``e^20 - 1``, where verl's clamp
  (k3 <= 10) drops the gradient from ``log_r ~ 2.6`` on.
- Tokens that ``is_cap_mode='mask'`` drops are removed with ``torch.where``, never multiplied by 0, so an
  infinite term there cannot become NaN.

Loss and gradients are finite for any finite log-probs at masked-in positions (and ``±inf`` ones for the token
ratio); a NaN there propagates.
"""

from __future__ import annotations

import math
import warnings
from typing import Literal

import torch

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_sum_fixed_len"]
RatioLevel = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k2", "k3"]
ISCapMode = Literal["truncate", "mask"]

LOG_RATIO_LIMIT = 20.0
"""Bound on every log-ratio the loss exponentiates (``e^20 ~ 4.85e8``); see the module docstring."""


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], expected_name: str) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected_name} = {expected}")


def _normaliser(
    name: str, value: float | torch.Tensor | None, default: torch.Tensor, like: torch.Tensor
) -> torch.Tensor | float:
    """``value`` (a finite float or 0-d real tensor > 0) on ``like``'s device and dtype, or ``default`` when None.

    A 0-d tensor is read to validate it: free on the CPU, one scalar device-to-host read on an accelerator (pass
    a Python float there to avoid it, as the train engine does). A device-side assert was the alternative; it
    leaves the CUDA context unusable and its message does not reach Python, so a notebook would lose its
    kernel's GPU over a bad argument. Unvalidated, a negative count silently flips the loss's sign and zero
    makes it infinite.
    """
    if value is None:
        return default
    allowed = "allowed a finite number > 0 (a float or a 0-d real tensor)"
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a float or 0-d tensor, got shape {tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"{name} has dtype {value.dtype}: {allowed}")
        if not 0 < float(value) < math.inf:
            raise ValueError(f"{name}={float(value)!r} (a 0-d tensor) is invalid: {allowed}")
        return value.to(device=like.device, dtype=like.dtype)
    if isinstance(value, bool) or not 0 < value < math.inf:
        raise ValueError(f"{name}={value!r} is invalid: {allowed}")
    return value


def kl_penalty(logprobs_B_C: torch.Tensor, ref_logprobs_B_C: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from samples of ``pi`` (Schulman, "Approximating KL
    Divergence", 2020). With ``log_r = ref_logprobs - logprobs``::

        k1 = -log_r                  unbiased, high variance, can be negative
        k2 = log_r ** 2 / 2          biased, low variance, >= 0
        k3 = exp(log_r) - log_r - 1  unbiased, low variance, >= 0 (GRPO's choice)

    As LOSS terms their expected gradients differ from their expected values (derivation in
    docs/howto/algorithms.md): k1's is zero (it penalises nothing), k2's is the gradient of ``KL(pi || ref)``,
    k3's the gradient of the reverse ``KL(ref || pi)``.

    k3 overflows float32 for ``log_r > 88.7``; above ``LOG_RATIO_LIMIT`` (20) it is continued linearly,
    ``k3(L) + (e^L - 1) (log_r - L)``, value and slope continuous at ``L``, so the estimate and its gradient stay
    finite and keep pulling toward the reference. Below it k3 is exact (computed as ``expm1(log_r) - log_r``,
    which avoids the cancellation of ``exp(log_r) - 1`` near 0).

    Args:
        logprobs_B_C: the policy's token log-probs (gradient flows through them).
        ref_logprobs_B_C: the reference policy's token log-probs (treated as constants), same shape.
        estimator: 'k1', 'k2' or 'k3'.

    Returns:
        ``kl_B_C``, same shape and dtype as ``logprobs_B_C``; mask it downstream.

    Raises:
        ValueError: shapes differ or ``estimator`` is unknown.
    """
    _check_shape("ref_logprobs_B_C", ref_logprobs_B_C, tuple(logprobs_B_C.shape), "logprobs_B_C.shape")
    log_r_B_C = ref_logprobs_B_C.detach() - logprobs_B_C
    if estimator == "k1":
        return -log_r_B_C
    if estimator == "k2":
        return 0.5 * log_r_B_C * log_r_B_C
    if estimator == "k3":
        inside_B_C = log_r_B_C.clamp(max=LOG_RATIO_LIMIT)  # its gradient passes AT the limit...
        beyond_B_C = torch.relu(log_r_B_C - LOG_RATIO_LIMIT)  # ...this one's does not, so it is counted once
        return torch.expm1(inside_B_C) - inside_B_C + math.expm1(LOG_RATIO_LIMIT) * beyond_B_C
    raise ValueError(f"estimator={estimator!r} is invalid: allowed 'k1', 'k2', 'k3'")


def policy_loss(
    logprobs_B_C: torch.Tensor,
    old_logprobs_B_C: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_C: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    loss_agg: LossAgg = "token_mean",
    ratio_level: RatioLevel = "token",
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    ref_logprobs_B_C: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    entropy_B_C: torch.Tensor | None = None,
    behaviour_logprobs_B_C: torch.Tensor | None = None,
    is_cap: float | None = None,
    is_cap_mode: ISCapMode = "truncate",
    num_tokens: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip policy loss of the GRPO family, with global-batch normalisers for data parallelism.

    Per completion token ``t`` of sequence ``i`` (advantage ``A_i``)::

        ratio_it = exp(logprobs_it - old_it)                                      ratio_level='token' (PPO)
        ratio_it = sg[s_i] * exp(logprobs_it - sg[logprobs_it]),                  ratio_level='sequence' (GSPO)
                   s_i = exp(sum_t (logprobs_it - old_it) / |y_i|)
        pg_it    = -w_it * min(ratio_it * A_i, clip(ratio_it, 1 - clip_eps_low, 1 + clip_eps_high) * A_i)
        l_it     = pg_it + kl_coef * KL_it - entropy_coef * entropy_it

    ``KL_it`` is :func:`kl_penalty` with ``kl_estimator``; ``w_it`` the importance weight, the sequence-level
    ratio, the aggregations and their global-batch normalisers, the gradients and the numerical guards are
    specified in the module docstring's sections of those names. ``kl_estimator='k1'`` with ``kl_coef > 0``
    warns (``UserWarning``): its expected gradient is zero, so the penalty adds only noise; use 'k2' or 'k3'.

    Args:
        logprobs_B_C: current policy's token log-probs (with grad), float.
        old_logprobs_B_C: the proximal ("old") policy's token log-probs, the PPO ratio's denominator.
        advantages_B: one advantage per sequence.
        mask_B_C: bool/int, True for completion tokens that count.
        clip_eps_low, clip_eps_high: >= 0; the ratio is clipped to ``[1 - low, 1 + high]``.
        loss_agg: 'token_mean', 'seq_mean_token_mean' or 'seq_sum_fixed_len' (module docstring, "Aggregation").
        ratio_level: 'token' (PPO/GRPO) or 'sequence' (GSPO).
        kl_coef: >= 0; weight of the KL penalty to the reference policy.
        kl_estimator: 'k1', 'k2' or 'k3'.
        ref_logprobs_B_C: reference policy's token log-probs; required when ``kl_coef > 0``.
        entropy_coef: >= 0; weight of the entropy bonus (subtracted from the loss).
        entropy_B_C: per-token entropy, in the autograd graph for a bonus; required when ``entropy_coef > 0``.
        behaviour_logprobs_B_C: the sampling (behaviour) policy's token log-probs, for the importance weight.
        is_cap: > 0, the importance weight's cap; None = uncapped.
        is_cap_mode: 'truncate' (TIS) or 'mask' (decoupled PPO's cap).
        num_tokens: finite float or 0-d tensor > 0, the global batch's completion-token count (token_mean).
        num_sequences: finite float or 0-d tensor > 0, the global batch's sequence count (seq_* aggregations).
        max_len: int >= 1, the fixed length of seq_sum_fixed_len (the rollout's ``max_new_tokens``).

    Returns:
        ``(loss, metrics)``: ``loss`` is a 0-d tensor; ``metrics`` are 0-d float32 tensors of SUMS over masked
        tokens, left on device (no host sync): ``loss_sum`` (of ``l_it``), ``clipped_tokens`` (tokens where
        the clipped term is the smaller one, i.e. the gradient is zeroed), ``ratio_sum``, ``kl_sum`` (the
        chosen estimator; 0 without a reference), ``tokens``, ``is_weight_sum`` (of ``w`` after the cap; equal
        to ``tokens`` without behaviour log-probs), ``is_capped_tokens`` (tokens whose weight hit the cap) and
        ``ratio_limited_tokens`` (tokens whose log-ratio lay beyond ``LOG_RATIO_LIMIT``: the guard engaged).

    Raises:
        ValueError: a tensor's shape differs from ``logprobs_B_C``'s (naming it), a negative coefficient or
            clip range, a missing input the options need, an unknown option, or a normaliser that is not a
            finite number > 0 (a 0-d tensor normaliser is read to check it: a host sync on an accelerator,
            so pass floats in a hot loop).
    """
    _check_loss_shapes(
        logprobs_B_C, old_logprobs_B_C, advantages_B, mask_B_C, ref_logprobs_B_C, entropy_B_C, behaviour_logprobs_B_C
    )
    _check_coefficients(clip_eps_low, clip_eps_high, kl_coef, ref_logprobs_B_C, entropy_coef, entropy_B_C)
    _check_choices(loss_agg, ratio_level, is_cap_mode, is_cap, max_len)
    _warn_if_k1_loss_term(kl_coef, kl_estimator)
    mask_B_C = mask_B_C.bool()
    zero = logprobs_B_C.new_zeros(())
    tokens_B = mask_B_C.sum(dim=1).to(logprobs_B_C.dtype)
    ratio_B_C, limited_B_C = _ratio(logprobs_B_C, old_logprobs_B_C, mask_B_C, tokens_B, ratio_level, zero)
    surrogate_B_C, clipped_surrogate_B_C, token_loss_B_C = _clipped_surrogate(
        ratio_B_C, advantages_B, logprobs_B_C.dtype, clip_eps_low, clip_eps_high
    )
    token_loss_B_C, weight_B_C, capped_B_C = _importance_weighted(
        token_loss_B_C, logprobs_B_C, old_logprobs_B_C, behaviour_logprobs_B_C, mask_B_C, is_cap, is_cap_mode, zero
    )
    token_loss_B_C, kl_sum = _regularised(
        token_loss_B_C, logprobs_B_C, ref_logprobs_B_C, entropy_B_C, mask_B_C, kl_coef, kl_estimator, entropy_coef, zero
    )
    masked_loss_B_C = torch.where(mask_B_C, token_loss_B_C, zero)
    loss_sum = masked_loss_B_C.sum()
    tokens = mask_B_C.sum().to(torch.float32)
    loss = _aggregate(masked_loss_B_C, loss_sum, tokens, tokens_B, loss_agg, num_tokens, num_sequences, max_len)
    clipped_B_C = (clipped_surrogate_B_C < surrogate_B_C) & mask_B_C
    return loss, _loss_metrics(
        loss_sum, tokens, kl_sum, mask_B_C, clipped_B_C, ratio_B_C, weight_B_C, capped_B_C, limited_B_C, zero
    )


def _check_loss_shapes(
    logprobs_B_C: torch.Tensor,
    old_logprobs_B_C: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_C: torch.Tensor,
    ref_logprobs_B_C: torch.Tensor | None,
    entropy_B_C: torch.Tensor | None,
    behaviour_logprobs_B_C: torch.Tensor | None,
) -> None:
    """Raise unless ``logprobs_B_C`` is ``[B, C]`` and every other tensor of :func:`policy_loss` matches it."""
    if logprobs_B_C.dim() != 2:
        raise ValueError(f"logprobs_B_C must be 2-D [B, C], got shape {tuple(logprobs_B_C.shape)}")
    shape_B_C = tuple(logprobs_B_C.shape)
    _check_shape("old_logprobs_B_C", old_logprobs_B_C, shape_B_C, "logprobs_B_C.shape")
    _check_shape("mask_B_C", mask_B_C, shape_B_C, "logprobs_B_C.shape")
    _check_shape("advantages_B", advantages_B, shape_B_C[:1], "(B,) of logprobs_B_C")
    for name, optional in (
        ("ref_logprobs_B_C", ref_logprobs_B_C),
        ("entropy_B_C", entropy_B_C),
        ("behaviour_logprobs_B_C", behaviour_logprobs_B_C),
    ):
        if optional is not None:
            _check_shape(name, optional, shape_B_C, "logprobs_B_C.shape")


def _check_coefficients(
    clip_eps_low: float,
    clip_eps_high: float,
    kl_coef: float,
    ref_logprobs_B_C: torch.Tensor | None,
    entropy_coef: float,
    entropy_B_C: torch.Tensor | None,
) -> None:
    """Raise on a negative clip range or coefficient of :func:`policy_loss`, or one > 0 without its input."""
    if clip_eps_low < 0 or clip_eps_high < 0:
        raise ValueError(f"clip_eps_low={clip_eps_low!r}, clip_eps_high={clip_eps_high!r}: both must be >= 0")
    if kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef!r} is invalid: allowed >= 0")
    if kl_coef > 0 and ref_logprobs_B_C is None:
        raise ValueError(f"kl_coef={kl_coef!r} > 0 needs ref_logprobs_B_C")
    if entropy_coef < 0:
        raise ValueError(f"entropy_coef={entropy_coef!r} is invalid: allowed >= 0")
    if entropy_coef > 0 and entropy_B_C is None:
        raise ValueError(f"entropy_coef={entropy_coef!r} > 0 needs entropy_B_C")


def _check_choices(
    loss_agg: str, ratio_level: str, is_cap_mode: str, is_cap: float | None, max_len: int | None
) -> None:
    """Raise on an unknown option of :func:`policy_loss`, a cap <= 0, or a missing ``max_len`` its aggregation needs."""
    if loss_agg not in ("token_mean", "seq_mean_token_mean", "seq_sum_fixed_len"):
        raise ValueError(
            f"loss_agg={loss_agg!r} is invalid: allowed 'token_mean', 'seq_mean_token_mean', 'seq_sum_fixed_len'"
        )
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"ratio_level={ratio_level!r} is invalid: allowed 'token', 'sequence'")
    if is_cap_mode not in ("truncate", "mask"):
        raise ValueError(f"is_cap_mode={is_cap_mode!r} is invalid: allowed 'truncate', 'mask'")
    if is_cap is not None and not is_cap > 0:
        raise ValueError(f"is_cap={is_cap!r} is invalid: allowed > 0 or None")
    if loss_agg == "seq_sum_fixed_len" and (max_len is None or max_len < 1):
        raise ValueError(f"max_len={max_len!r} is invalid for loss_agg='seq_sum_fixed_len': allowed an int >= 1")


def _warn_if_k1_loss_term(kl_coef: float, kl_estimator: str) -> None:
    """Warn, at the caller of :func:`policy_loss`, that k1 as a loss term penalises nothing."""
    if kl_coef > 0 and kl_estimator == "k1":
        warnings.warn(
            f"kl_estimator='k1' with kl_coef={kl_coef!r} > 0 penalises nothing: k1's expected gradient is zero "
            "(E_pi[grad log pi] = 0), so the term adds only noise. Use 'k2' (gradient of KL(pi||ref)) or 'k3' "
            "(gradient of KL(ref||pi)); see docs/howto/algorithms.md.",
            UserWarning,
            stacklevel=3,
        )


def _ratio(
    logprobs_B_C: torch.Tensor,
    old_logprobs_B_C: torch.Tensor,
    mask_B_C: torch.Tensor,
    tokens_B: torch.Tensor,
    ratio_level: str,
    zero: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ratio_B_C, limited_B_C)``: the PPO ratio (token- or GSPO's sequence-level), its log clamped to
    ``±LOG_RATIO_LIMIT`` before ``exp``, and the masked tokens whose log-ratio lay beyond that limit."""
    # torch.where (not multiplication) so that garbage at masked positions cannot leak NaN into sums or grads.
    log_ratio_B_C = torch.where(mask_B_C, logprobs_B_C - old_logprobs_B_C.detach(), zero)
    if ratio_level == "sequence":
        seq_log_ratio_B_1 = (log_ratio_B_C.sum(dim=1) / tokens_B.clamp(min=1.0)).unsqueeze(1)
        safe_logprobs_B_C = torch.where(mask_B_C, logprobs_B_C, zero)
        log_ratio_B_C = seq_log_ratio_B_1.detach() + safe_logprobs_B_C - safe_logprobs_B_C.detach()
    limited_B_C = (log_ratio_B_C.detach().abs() > LOG_RATIO_LIMIT) & mask_B_C
    ratio_B_C = log_ratio_B_C.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    return ratio_B_C, limited_B_C


def _clipped_surrogate(
    ratio_B_C: torch.Tensor, advantages_B: torch.Tensor, dtype: torch.dtype, clip_eps_low: float, clip_eps_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(surrogate_B_C, clipped_surrogate_B_C, -min(both))``: PPO's two surrogate terms and its token loss."""
    advantages_B_1 = advantages_B.detach().to(dtype).unsqueeze(1)
    surrogate_B_C = ratio_B_C * advantages_B_1
    clipped_surrogate_B_C = ratio_B_C.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages_B_1
    return surrogate_B_C, clipped_surrogate_B_C, -torch.minimum(surrogate_B_C, clipped_surrogate_B_C)


def _importance_weighted(
    token_loss_B_C: torch.Tensor,
    logprobs_B_C: torch.Tensor,
    old_logprobs_B_C: torch.Tensor,
    behaviour_logprobs_B_C: torch.Tensor | None,
    mask_B_C: torch.Tensor,
    is_cap: float | None,
    is_cap_mode: str,
    zero: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token_loss_B_C * w_B_C, w_B_C, capped_B_C)``: the off-policy correction (module docstring), a weight
    of 1 and no token capped without behaviour log-probs."""
    shape_B_C = tuple(logprobs_B_C.shape)
    one = logprobs_B_C.new_ones(())
    weight_B_C = one.expand(shape_B_C)
    capped_B_C = torch.zeros(shape_B_C, dtype=torch.bool, device=logprobs_B_C.device)
    if behaviour_logprobs_B_C is not None:
        behaviour_log_w_B_C = old_logprobs_B_C.detach() - behaviour_logprobs_B_C.detach()
        log_w_B_C = torch.where(mask_B_C, behaviour_log_w_B_C.to(logprobs_B_C.dtype), zero)
        weight_B_C = log_w_B_C.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
        if is_cap is not None:
            capped_B_C = (weight_B_C > is_cap) & mask_B_C
            capped_value = is_cap if is_cap_mode == "truncate" else 0.0
            weight_B_C = torch.where(capped_B_C, capped_value, weight_B_C)
        token_loss_B_C = weight_B_C * token_loss_B_C
        if is_cap_mode == "mask":  # dropped, not multiplied by 0: 0 * inf would be NaN
            token_loss_B_C = torch.where(capped_B_C, zero, token_loss_B_C)
    return token_loss_B_C, weight_B_C, capped_B_C


def _regularised(
    token_loss_B_C: torch.Tensor,
    logprobs_B_C: torch.Tensor,
    ref_logprobs_B_C: torch.Tensor | None,
    entropy_B_C: torch.Tensor | None,
    mask_B_C: torch.Tensor,
    kl_coef: float,
    kl_estimator: KLEstimator,
    entropy_coef: float,
    zero: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_loss_B_C + kl_coef * KL_B_C - entropy_coef * entropy_B_C, kl_sum)``: each term only when its
    coefficient is > 0; ``kl_sum`` (the metric, float32) whenever a reference is given, else 0."""
    if ref_logprobs_B_C is not None:
        safe_ref_B_C = torch.where(mask_B_C, ref_logprobs_B_C.detach(), zero)
        kl_B_C = kl_penalty(torch.where(mask_B_C, logprobs_B_C, zero), safe_ref_B_C, kl_estimator)
        if kl_coef > 0:
            token_loss_B_C = token_loss_B_C + kl_coef * kl_B_C
        kl_sum = torch.where(mask_B_C, kl_B_C, zero).sum().detach().float()
    else:
        kl_sum = zero.detach().float()
    if entropy_B_C is not None and entropy_coef > 0:
        token_loss_B_C = token_loss_B_C - entropy_coef * torch.where(mask_B_C, entropy_B_C, zero)
    return token_loss_B_C, kl_sum


def _aggregate(
    masked_loss_B_C: torch.Tensor,
    loss_sum: torch.Tensor,
    tokens: torch.Tensor,
    tokens_B: torch.Tensor,
    loss_agg: str,
    num_tokens: float | torch.Tensor | None,
    num_sequences: float | torch.Tensor | None,
    max_len: int | None,
) -> torch.Tensor:
    """The loss under ``loss_agg`` (module docstring, "Aggregation"), each normaliser validated or defaulted."""
    if loss_agg == "token_mean":
        return loss_sum / _normaliser("num_tokens", num_tokens, tokens.to(loss_sum.dtype).clamp(min=1.0), loss_sum)
    default_sequences = loss_sum.new_tensor(float(max(masked_loss_B_C.shape[0], 1)))  # B = 0: loss 0, not 0 / 0
    sequences = _normaliser("num_sequences", num_sequences, default_sequences, loss_sum)
    if loss_agg == "seq_mean_token_mean":
        return (masked_loss_B_C.sum(dim=1) / tokens_B.clamp(min=1.0)).sum() / sequences
    assert max_len is not None  # checked by _check_choices
    return loss_sum / (sequences * max_len)


def grpo_loss(
    logprobs_B_C: torch.Tensor,
    old_logprobs_B_C: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_C: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    kl_coef: float = 0.0,
    ref_logprobs_B_C: torch.Tensor | None = None,
    num_tokens: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's clipped surrogate loss (DeepSeekMath, Shao et al. 2024) with DAPO's token-level mean.

    :func:`policy_loss` with its defaults (token-level ratio, ``token_mean``, k3 KL, no entropy bonus, no
    importance weight); kept for its fixed signature.

    Per completion token, with ``ratio = exp(logprobs - old_logprobs)`` and the sequence's advantage ``A``::

        loss_t = -min(ratio * A, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A)
                 + kl_coef * (exp(ref - logprobs) - (ref - logprobs) - 1)   # k3 KL estimator, if kl_coef > 0

    ``loss = sum over masked tokens of loss_t / num_tokens``. The numerical guards of :func:`policy_loss` apply
    (log-ratio clamped to ``±LOG_RATIO_LIMIT`` before ``exp``, k3 continued linearly beyond it). Unlike the
    per-sequence mean of the GRPO paper, every token weighs the same (DAPO, Yu et al. 2025; asymmetric
    "clip-higher" via ``clip_eps_high``).
    ``num_tokens`` is the completion-token count of the GLOBAL batch: micro-batches (or ranks) that each pass
    the global count sum to the global token mean, so gradient accumulation and data parallelism need no
    rescaling. It defaults to ``mask_B_C.sum()`` (this batch is the global batch).

    Gradients flow through ``logprobs_B_C`` only; ``old_logprobs_B_C``, ``ref_logprobs_B_C`` and
    ``advantages_B`` are treated as constants (detached). Masked positions may hold any finite or non-finite
    value.

    Args:
        logprobs_B_C: current policy's token log-probs (with grad), float.
        old_logprobs_B_C: behaviour policy's token log-probs.
        advantages_B: one advantage per sequence.
        mask_B_C: bool/int, True for completion tokens that count.
        clip_eps_low, clip_eps_high: >= 0; the ratio is clipped to ``[1 - low, 1 + high]``.
        kl_coef: >= 0; weight of the k3 KL penalty to the reference policy.
        ref_logprobs_B_C: reference policy's token log-probs; required when ``kl_coef > 0``.
        num_tokens: float or 0-d tensor > 0, the global batch's completion-token count.

    Returns:
        ``(loss, metrics)``: ``loss`` is a 0-d tensor; ``metrics`` are 0-d float32 tensors of SUMS over masked
        tokens, left on device (no host sync): ``loss_sum``, ``clipped_tokens`` (tokens where the clipped term
        is the smaller one, i.e. the gradient is zeroed), ``ratio_sum``, ``kl_sum`` (k3; 0 without a
        reference) and ``tokens``. Divide by the (all-reduced) ``tokens`` for means.

    Raises:
        ValueError: a tensor's shape differs from ``logprobs_B_C``'s (naming it), negative clip or KL
            coefficients, or ``kl_coef > 0`` without ``ref_logprobs_B_C``.
    """
    loss, metrics = policy_loss(
        logprobs_B_C,
        old_logprobs_B_C,
        advantages_B,
        mask_B_C,
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        kl_coef=kl_coef,
        kl_estimator="k3",
        ref_logprobs_B_C=ref_logprobs_B_C,
        num_tokens=num_tokens,
    )
    return loss, {k: metrics[k] for k in ("loss_sum", "clipped_tokens", "ratio_sum", "kl_sum", "tokens")}


def _loss_metrics(
    loss_sum: torch.Tensor,
    tokens: torch.Tensor,
    kl_sum: torch.Tensor,
    mask_B_C: torch.Tensor,
    clipped_B_C: torch.Tensor,
    ratio_B_C: torch.Tensor,
    weight_B_C: torch.Tensor,
    capped_B_C: torch.Tensor,
    limited_B_C: torch.Tensor,
    zero: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """:func:`policy_loss`'s metrics: 0-d float32 sums over masked tokens, left on device."""
    return {
        "loss_sum": loss_sum.detach().float(),
        "clipped_tokens": clipped_B_C.sum().to(torch.float32),
        "ratio_sum": torch.where(mask_B_C, ratio_B_C, zero).sum().detach().float(),
        "kl_sum": kl_sum,
        "tokens": tokens,
        "is_weight_sum": torch.where(mask_B_C, weight_B_C, zero).sum().detach().float(),
        "is_capped_tokens": capped_B_C.sum().to(torch.float32),
        "ratio_limited_tokens": limited_B_C.sum().to(torch.float32),
    }
