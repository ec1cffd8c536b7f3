"""Policy losses. Shape names: ``B`` = sequences, ``C`` = completion tokens (right-padded)."""

from __future__ import annotations

import torch


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], expected_name: str) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected_name} = {expected}")


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

    Per completion token, with ``ratio = exp(logprobs - old_logprobs)`` and the sequence's advantage ``A``::

        loss_t = -min(ratio * A, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A)
                 + kl_coef * (exp(ref - logprobs) - (ref - logprobs) - 1)   # k3 KL estimator, if kl_coef > 0

    ``loss = sum over masked tokens of loss_t / num_tokens``. Unlike the per-sequence mean of the GRPO paper,
    every token weighs the same (DAPO, Yu et al. 2025; asymmetric "clip-higher" via ``clip_eps_high``).
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
    if logprobs_B_C.dim() != 2:
        raise ValueError(f"logprobs_B_C must be 2-D [B, C], got shape {tuple(logprobs_B_C.shape)}")
    shape_B_C = tuple(logprobs_B_C.shape)
    _check_shape("old_logprobs_B_C", old_logprobs_B_C, shape_B_C, "logprobs_B_C.shape")
    _check_shape("mask_B_C", mask_B_C, shape_B_C, "logprobs_B_C.shape")
    _check_shape("advantages_B", advantages_B, shape_B_C[:1], "(B,) of logprobs_B_C")
    if ref_logprobs_B_C is not None:
        _check_shape("ref_logprobs_B_C", ref_logprobs_B_C, shape_B_C, "logprobs_B_C.shape")
    if clip_eps_low < 0 or clip_eps_high < 0:
        raise ValueError(f"clip_eps_low={clip_eps_low!r}, clip_eps_high={clip_eps_high!r}: both must be >= 0")
    if kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef!r} is invalid: allowed >= 0")
    if kl_coef > 0 and ref_logprobs_B_C is None:
        raise ValueError(f"kl_coef={kl_coef!r} > 0 needs ref_logprobs_B_C")

    mask_B_C = mask_B_C.bool()
    zero = logprobs_B_C.new_zeros(())
    # torch.where (not multiplication) so that garbage at masked positions cannot leak NaN into sums or grads.
    log_ratio_B_C = torch.where(mask_B_C, logprobs_B_C - old_logprobs_B_C.detach(), zero)
    ratio_B_C = log_ratio_B_C.exp()
    advantages_B_1 = advantages_B.detach().to(logprobs_B_C.dtype).unsqueeze(1)
    surrogate_B_C = ratio_B_C * advantages_B_1
    clipped_surrogate_B_C = ratio_B_C.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages_B_1
    token_loss_B_C = -torch.minimum(surrogate_B_C, clipped_surrogate_B_C)

    if ref_logprobs_B_C is not None:
        ref_log_ratio_B_C = torch.where(mask_B_C, ref_logprobs_B_C.detach() - logprobs_B_C, zero)
        kl_B_C = ref_log_ratio_B_C.exp() - ref_log_ratio_B_C - 1.0
        if kl_coef > 0:
            token_loss_B_C = token_loss_B_C + kl_coef * kl_B_C
        kl_sum = torch.where(mask_B_C, kl_B_C, zero).sum().detach().float()
    else:
        kl_sum = zero.detach().float()

    tokens = mask_B_C.sum().to(torch.float32)
    loss_sum = torch.where(mask_B_C, token_loss_B_C, zero).sum()
    if num_tokens is None:
        denominator = tokens.clamp(min=1.0)
    elif isinstance(num_tokens, torch.Tensor):
        if num_tokens.dim() != 0:
            raise ValueError(f"num_tokens must be a float or 0-d tensor, got shape {tuple(num_tokens.shape)}")
        denominator = num_tokens.to(device=loss_sum.device, dtype=loss_sum.dtype)
    else:
        if not num_tokens > 0:
            raise ValueError(f"num_tokens={num_tokens!r} is invalid: allowed > 0")
        denominator = num_tokens
    loss = loss_sum / denominator

    clipped_B_C = (clipped_surrogate_B_C < surrogate_B_C) & mask_B_C
    metrics = {
        "loss_sum": loss_sum.detach().float(),
        "clipped_tokens": clipped_B_C.sum().to(torch.float32),
        "ratio_sum": torch.where(mask_B_C, ratio_B_C, zero).sum().detach().float(),
        "kl_sum": kl_sum,
        "tokens": tokens,
    }
    return loss, metrics
