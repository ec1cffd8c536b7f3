"""Token log-probabilities and entropies straight from hidden states, the LM head applied one token chunk at a time.

Why: at a real vocabulary the LM head's output dominates a micro-batch's memory. ``[B, C, V]`` float32 logits of
16 sequences x 384 tokens x 151,936 entries are 3.7 GB, and ``log_softmax`` plus autograd keep several tensors of
that size alive until the backward. Here the head ``hidden @ weight.T`` runs on ``N`` tokens at a time: the forward
keeps only the per-token results, and the backward recomputes each chunk's logits and turns them straight into the
gradients of the hidden states and of the head weight (a custom autograd function, as Liger-Kernel's fused linear
cross-entropy and verl's fused PPO head do). The peak is one chunk's ``[N, V]`` float32 logits and their softmax,
whatever ``B x C``.

Formulas (``z = logits / temperature``, ``logp = log_softmax(z)``, ``p = exp(logp)``, target ``y``)::

    logprob = logp_y                            d logprob / dz = onehot(y) - p
    entropy = -sum_v p_v logp_v                 d entropy / dz = -p * (logp + entropy)

Precision: the head's GEMM runs in the compute dtype (the weight's, or the autocast dtype when autocast is on for
the weight's device), everything after it (softmax, log-probs, entropies, their gradients) in float32, as the
one-call path does with ``logits.float()``.
"""

from __future__ import annotations

from typing import Any

import torch


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's GEMM runs in: autocast's when autocast is enabled for the weight's device type."""
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def tokens_per_chunk(vocab_size: int, chunk_bytes: int) -> int:
    """Tokens whose float32 logits fit in ``chunk_bytes`` (at least 1)."""
    return max(1, chunk_bytes // (4 * max(vocab_size, 1)))


def _chunk_log_softmax(
    hidden_N_H: torch.Tensor,
    weight_V_H: torch.Tensor,
    bias_V: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """``log_softmax((hidden @ weight.T + bias) / temperature)`` of one chunk, float32, in one ``[n, V]`` buffer.

    The max is subtracted before the log-sum-exp, as ``torch.log_softmax`` does: the log-probabilities (and the
    entropy built from them) keep their absolute accuracy however large the logits are."""
    z_N_V = (hidden_N_H @ weight_V_H.T).float()
    if bias_V is not None:
        z_N_V += bias_V.float()
    if temperature != 1.0:
        z_N_V /= temperature
    z_N_V -= z_N_V.amax(dim=-1, keepdim=True)
    return z_N_V.sub_(torch.logsumexp(z_N_V, dim=-1, keepdim=True))


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """``(logprobs_N, entropy_N)`` of ``softmax((hidden @ weight.T + bias) / temperature)`` at ``tokens_N``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden_N_H: torch.Tensor,
        weight_V_H: torch.Tensor,
        bias_V: torch.Tensor | None,
        tokens_N: torch.Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = compute_dtype(weight_V_H)
        device_type = weight_V_H.device.type
        num_tokens = hidden_N_H.shape[0]
        logprobs_N = torch.empty(num_tokens, dtype=torch.float32, device=hidden_N_H.device)
        entropy_N = torch.zeros(num_tokens, dtype=torch.float32, device=hidden_N_H.device)
        weight_c = weight_V_H.to(dtype)
        with torch.autocast(device_type, enabled=False):
            for lo in range(0, num_tokens, chunk):
                hi = min(lo + chunk, num_tokens)
                logp_n_V = _chunk_log_softmax(hidden_N_H[lo:hi].to(dtype), weight_c, bias_V, temperature)
                logprobs_N[lo:hi] = logp_n_V.gather(-1, tokens_N[lo:hi, None]).squeeze(-1)
                if with_entropy:
                    entropy_N[lo:hi] = -logp_n_V.exp().mul_(logp_n_V).sum(dim=-1)
                del logp_n_V
        ctx.save_for_backward(hidden_N_H, weight_V_H, bias_V, tokens_N, entropy_N)
        ctx.weight_c = weight_c if weight_c is not weight_V_H else None  # the cast copy, reused by the backward
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy_N)
        return logprobs_N, entropy_N

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logprobs_N: torch.Tensor | None, grad_entropy_N: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden_N_H, weight_V_H, bias_V, tokens_N, entropy_N = ctx.saved_tensors
        dtype, temperature, chunk = ctx.dtype, ctx.temperature, ctx.chunk
        weight_c = ctx.weight_c if ctx.weight_c is not None else weight_V_H
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if grad_logprobs_N is None and grad_entropy_N is None:
            return None, None, None, None, None, None, None
        num_tokens = hidden_N_H.shape[0]
        grad_hidden_N_H = torch.empty_like(hidden_N_H) if need_hidden else None
        grad_weight_V_H = torch.zeros_like(weight_V_H) if need_weight else None
        grad_bias_V = (
            torch.zeros(weight_V_H.shape[0], dtype=torch.float32, device=weight_V_H.device) if need_bias else None
        )
        with torch.autocast(weight_V_H.device.type, enabled=False):
            for lo in range(0, num_tokens, chunk):
                hi = min(lo + chunk, num_tokens)
                hidden_n_H = hidden_N_H[lo:hi].to(dtype)
                logp_n_V = _chunk_log_softmax(hidden_n_H, weight_c, bias_V, temperature)
                p_n_V = logp_n_V.exp()
                # d loss / dz = -p * (g_lp + g_ent * (logp + H)) + g_lp * onehot(y), in the two [n, V] buffers
                factor_n_V = logp_n_V
                if grad_entropy_N is not None:
                    factor_n_V.add_(entropy_N[lo:hi, None]).mul_(grad_entropy_N[lo:hi, None].float())
                    if grad_logprobs_N is not None:
                        factor_n_V.add_(grad_logprobs_N[lo:hi, None].float())
                else:
                    factor_n_V = grad_logprobs_N[lo:hi, None].float().expand_as(p_n_V)
                grad_z_n_V = p_n_V.mul_(factor_n_V).neg_()
                del factor_n_V, logp_n_V
                if grad_logprobs_N is not None:
                    grad_z_n_V.scatter_add_(-1, tokens_N[lo:hi, None], grad_logprobs_N[lo:hi, None].float())
                if temperature != 1.0:
                    grad_z_n_V /= temperature
                if grad_bias_V is not None:
                    grad_bias_V += grad_z_n_V.sum(dim=0)
                grad_logits_n_V = grad_z_n_V.to(dtype)
                del grad_z_n_V
                if grad_hidden_N_H is not None:
                    grad_hidden_N_H[lo:hi] = grad_logits_n_V @ weight_c
                if grad_weight_V_H is not None:
                    if grad_weight_V_H.dtype == dtype:
                        grad_weight_V_H.addmm_(grad_logits_n_V.T, hidden_n_H)
                    else:  # autocast: a low-precision GEMM into the full-precision weight's gradient
                        grad_weight_V_H += grad_logits_n_V.T @ hidden_n_H
        if grad_bias_V is not None:
            grad_bias_V = grad_bias_V.to(bias_V.dtype)
        return grad_hidden_N_H, grad_weight_V_H, grad_bias_V, None, None, None, None


def head_logprobs(
    hidden_B_T_H: torch.Tensor,
    weight_V_H: torch.Tensor,
    tokens_B_T: torch.Tensor,
    *,
    bias_V: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_bytes: int = 32 * 2**20,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and entropies) of ``tokens_B_T`` under ``softmax((hidden @ weight.T + bias) / temperature)``,
    never holding more than one chunk of float32 logits (see the module docstring).

    Equal to ``token_logprobs(lm_head(hidden), tokens, temperature)`` (and ``token_entropy``) to float rounding,
    values and gradients (to ``hidden``, ``weight`` and ``bias``); tested against a float64 reference.

    Args:
        hidden_B_T_H: the final hidden states that predict ``tokens_B_T`` (already shifted).
        weight_V_H: the LM head's weight; ``bias_V`` its bias (most causal LMs have none).
        tokens_B_T: int64 target ids.
        temperature: > 0.
        with_entropy: also return the entropy at every position.
        entropy_grad: keep the entropy differentiable (an entropy bonus); otherwise it is a detached metric.
        chunk_bytes: > 0, the float32 logits of one chunk: ``chunk_bytes // (4 V)`` tokens (at least one).

    Returns:
        ``(logprobs_B_T, entropy_B_T or None)``, float32, in nats.

    Raises:
        ValueError: shapes disagree, ``temperature <= 0`` or ``chunk_bytes <= 0``.
    """
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} is invalid: allowed > 0")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes!r} is invalid: allowed > 0")
    if (
        hidden_B_T_H.dim() != 3
        or tokens_B_T.shape != hidden_B_T_H.shape[:2]
        or weight_V_H.dim() != 2
        or weight_V_H.shape[1] != hidden_B_T_H.shape[2]
    ):
        raise ValueError(
            f"hidden_B_T_H shape {tuple(hidden_B_T_H.shape)}, weight_V_H shape {tuple(weight_V_H.shape)} and "
            f"tokens_B_T shape {tuple(tokens_B_T.shape)} disagree: need [B, T, H], [V, H] and [B, T]"
        )
    if bias_V is not None and tuple(bias_V.shape) != (weight_V_H.shape[0],):
        raise ValueError(f"bias_V shape {tuple(bias_V.shape)} must be ({weight_V_H.shape[0]},)")
    batch, time = tokens_B_T.shape
    hidden_N_H = hidden_B_T_H.reshape(batch * time, hidden_B_T_H.shape[2])
    tokens_N = tokens_B_T.reshape(-1).long()
    chunk = tokens_per_chunk(weight_V_H.shape[0], chunk_bytes)
    logprobs_N, entropy_N = _ChunkedHeadLogprobs.apply(
        hidden_N_H, weight_V_H, bias_V, tokens_N, float(temperature), chunk, with_entropy
    )
    entropy_B_T = None
    if with_entropy:
        entropy_B_T = (entropy_N if entropy_grad else entropy_N.detach()).reshape(batch, time)
    return logprobs_N.reshape(batch, time), entropy_B_T
