"""Supervised fine-tuning loss: masked token-mean negative log-likelihood of the completion tokens.

Shape names: ``B`` = sequences, ``C`` = completion tokens (right-padded).

Completion-only loss, as TRL's ``SFTTrainer`` computes it for prompt-completion data (``completion_only_loss``):
prompt tokens are context, never targets. Here that holds by construction: the batch keeps the prompt
(``prompt_ids_B_P``) and the completion (``completion_ids_B_C``) apart, the log-probabilities are those of the
completion tokens only (:func:`rlsdk.algorithms.completion_logprobs`), and ``mask_B_C`` drops the padding after
each completion.

The mean is over the tokens of the WHOLE batch, not per micro-batch or per sequence: each micro-batch divides its
sum by the global count (divided by the world size when DDP averages the ranks' gradients), so accumulating the
micro-batches and averaging the ranks gives exactly the gradient of the one-batch loss, whatever the split. (A
per-micro-batch mean would weigh a token of a short micro-batch more than one of a long one: the loss would depend
on ``train.micro_batch_size`` and the rank count.)
"""

from __future__ import annotations

import torch


def sft_loss(
    logprobs_B_C: torch.Tensor, mask_B_C: torch.Tensor, *, num_tokens: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``loss = -sum_{b,c} mask[b,c] * logprobs[b,c] / num_tokens``.

    Args:
        logprobs_B_C: log-probabilities of the target completion tokens (gradient flows through them), in nats.
        mask_B_C: bool/0-1, True for the tokens trained on (the completion, its EOS included; not the padding).
        num_tokens: float or 0-d tensor > 0, the normaliser: the completion-token count of the global batch
            (divided by the world size under gradient averaging); ``None`` = this call's ``mask_B_C.sum()``
            (at least 1).

    Returns:
        ``(loss, metrics)``: the scalar loss (dtype of ``logprobs_B_C``) and, detached, ``nll_sum`` (the summed
        negative log-likelihood of the masked tokens) and ``tokens`` (their count), both float64.

    Raises:
        ValueError: shapes differ, or ``num_tokens`` is not > 0 or not a scalar.
    """
    if logprobs_B_C.dim() != 2 or tuple(logprobs_B_C.shape) != tuple(mask_B_C.shape):
        raise ValueError(
            f"logprobs_B_C shape {tuple(logprobs_B_C.shape)} and mask_B_C shape {tuple(mask_B_C.shape)} must be "
            "equal and 2-D [B, C]"
        )
    mask_B_C = mask_B_C.to(logprobs_B_C.dtype)
    tokens = mask_B_C.sum()
    nll_sum = -(logprobs_B_C * mask_B_C).sum()
    if num_tokens is None:
        denominator: float | torch.Tensor = tokens.clamp(min=1.0)
    elif isinstance(num_tokens, torch.Tensor):
        if num_tokens.dim() != 0:
            raise ValueError(f"num_tokens must be a float or 0-d tensor, got shape {tuple(num_tokens.shape)}")
        denominator = num_tokens.to(device=logprobs_B_C.device, dtype=logprobs_B_C.dtype)
    else:
        if not num_tokens > 0:
            raise ValueError(f"num_tokens={num_tokens!r} is invalid: allowed > 0")
        denominator = num_tokens
    loss = nll_sum / denominator
    return loss, {"nll_sum": nll_sum.detach().double(), "tokens": tokens.detach().double()}
