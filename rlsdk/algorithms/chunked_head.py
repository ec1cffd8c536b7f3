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


class _Workspace:
    """The ``[chunk, V]`` buffers every chunk of one forward or backward reuses: the head's GEMM output in the
    compute dtype, float32 log-probabilities and probabilities, and (autocast on a float32 weight) the head weight's
    per-chunk gradient in the compute dtype.

    Why: allocated per chunk, these are tens of MiB each and hundreds of them per micro-batch; torch's CPU tensors
    come from ``malloc``, which maps blocks that large fresh from the system every time, so each one is paid in page
    faults. Allocated once per call, they are faulted in once.
    """

    def __init__(self, rows: int, weight_V_H: torch.Tensor, dtype: torch.dtype, *, weight_grad: bool) -> None:
        vocab, hidden = weight_V_H.shape
        device = weight_V_H.device
        self.logp = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        self.p = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        self.z = None if dtype == torch.float32 else torch.empty(rows, vocab, dtype=dtype, device=device)
        self.weight_grad = torch.empty(vocab, hidden, dtype=dtype, device=device) if weight_grad else None


def _chunk_softmax(
    hidden_n_H: torch.Tensor,
    weight_V_H: torch.Tensor,
    bias_V: torch.Tensor | None,
    temperature: float,
    space: _Workspace,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_softmax, softmax)`` of ``(hidden @ weight.T + bias) / temperature`` for one chunk, float32, written
    into the workspace (views of its first ``n`` rows; the next chunk overwrites them).

    The max is subtracted before the exponent, as ``torch.log_softmax`` does: the log-probabilities (and the
    entropy built from them) keep their absolute accuracy however large the logits are."""
    n = hidden_n_H.shape[0]
    logp_n_V, p_n_V = space.logp[:n], space.p[:n]
    if space.z is None:
        torch.matmul(hidden_n_H, weight_V_H.T, out=logp_n_V)
    else:
        z_n_V = space.z[:n]
        torch.matmul(hidden_n_H, weight_V_H.T, out=z_n_V)
        logp_n_V.copy_(z_n_V)
    if bias_V is not None:
        logp_n_V += bias_V.float()
    if temperature != 1.0:
        logp_n_V /= temperature
    logp_n_V -= logp_n_V.amax(dim=-1, keepdim=True)
    torch.exp(logp_n_V, out=p_n_V)
    total_n_1 = p_n_V.sum(dim=-1, keepdim=True)
    p_n_V /= total_n_1
    logp_n_V -= total_n_1.log_()
    return logp_n_V, p_n_V


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
        space = _Workspace(min(chunk, max(num_tokens, 1)), weight_V_H, dtype, weight_grad=False)
        with torch.autocast(device_type, enabled=False):
            for lo in range(0, num_tokens, chunk):
                hi = min(lo + chunk, num_tokens)
                logp_n_V, p_n_V = _chunk_softmax(hidden_N_H[lo:hi].to(dtype), weight_c, bias_V, temperature, space)
                logprobs_N[lo:hi] = logp_n_V.gather(-1, tokens_N[lo:hi, None]).squeeze(-1)
                if with_entropy:
                    entropy_N[lo:hi] = -p_n_V.mul_(logp_n_V).sum(dim=-1)
        del space
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
        # autocast: a low-precision GEMM per chunk into the full-precision weight's gradient, through a buffer
        widen = grad_weight_V_H is not None and grad_weight_V_H.dtype != dtype
        space = _Workspace(min(chunk, max(num_tokens, 1)), weight_V_H, dtype, weight_grad=widen)
        with torch.autocast(weight_V_H.device.type, enabled=False):
            for lo in range(0, num_tokens, chunk):
                hi = min(lo + chunk, num_tokens)
                hidden_n_H = hidden_N_H[lo:hi].to(dtype)
                logp_n_V, p_n_V = _chunk_softmax(hidden_n_H, weight_c, bias_V, temperature, space)
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
                if space.z is None:
                    grad_logits_n_V = grad_z_n_V
                else:
                    grad_logits_n_V = space.z[: hi - lo]
                    grad_logits_n_V.copy_(grad_z_n_V)
                del grad_z_n_V
                if grad_hidden_N_H is not None:
                    if grad_hidden_N_H.dtype == dtype and grad_hidden_N_H.is_contiguous():
                        torch.matmul(grad_logits_n_V, weight_c, out=grad_hidden_N_H[lo:hi])
                    else:  # autocast on float32 hidden states
                        grad_hidden_N_H[lo:hi] = grad_logits_n_V @ weight_c
                if grad_weight_V_H is not None:
                    if space.weight_grad is None:
                        grad_weight_V_H.addmm_(grad_logits_n_V.T, hidden_n_H)
                    else:
                        torch.matmul(grad_logits_n_V.T, hidden_n_H, out=space.weight_grad)
                        grad_weight_V_H += space.weight_grad
        del space
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
