"""Gradients of policy_loss against closed forms derived by hand, token by token.

Each expected gradient is written from the math (not from the implementation's conventions): for a token t of
sequence i with aggregation weight ``w_it`` (token_mean ``1/N``, seq_mean_token_mean ``1/(|y_i| B)``,
seq_sum_fixed_len ``1/(B max_len)``):

    d pg / d logp_it  = -A_i r_it     when the unclipped branch is the smaller one, else 0
    d KL / d logp_it  = 1 (k1),  logp - ref (k2),  1 - exp(ref - logp) (k3)
    d loss / d H_it   = -entropy_coef
all times ``w_it``.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from rlsdk.algorithms import policy_loss

LOW, HIGH = 0.2, 0.28
AGGS = ["token_mean", "seq_mean_token_mean", "seq_sum_fixed_len"]
MAX_LEN = 13  # deliberately not the padded width (7)


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 7, 1, 3, 0, 2])
    old = -torch.rand(6, 7, generator=g, dtype=torch.float64) * 3
    return {
        "old": old,
        "logp": old + torch.randn(6, 7, generator=g, dtype=torch.float64) * 0.3,
        "ref": old + torch.randn(6, 7, generator=g, dtype=torch.float64) * 0.5,
        "entropy": torch.rand(6, 7, generator=g, dtype=torch.float64),
        "adv": torch.randn(6, generator=g, dtype=torch.float64),
        "mask": torch.arange(7).unsqueeze(0) < lengths.unsqueeze(1),
    }


def _weights(mask: torch.Tensor, loss_agg: str) -> torch.Tensor:
    batch, mask = mask.shape[0], mask.double()
    if loss_agg == "token_mean":
        return mask / mask.sum().clamp(min=1)
    if loss_agg == "seq_mean_token_mean":
        return mask / mask.sum(1, keepdim=True).clamp(min=1) / batch
    return mask / (batch * MAX_LEN)


def _pg_grad(log_ratio: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    ratio = log_ratio.exp()
    a = adv.unsqueeze(1).expand_as(ratio)
    unclipped = torch.where(a > 0, ratio <= 1 + HIGH, ratio >= 1 - LOW)
    return torch.where(unclipped, -a * ratio, torch.zeros_like(ratio))


def _grads(data: dict[str, torch.Tensor], **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    logp = data["logp"].clone().requires_grad_(True)
    entropy = data["entropy"].clone().requires_grad_(True)
    loss, _ = policy_loss(
        logp, data["old"], data["adv"], data["mask"], clip_eps_low=LOW, clip_eps_high=HIGH, max_len=MAX_LEN,
        ref_logprobs_B_C=data["ref"], entropy_B_C=entropy, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    grad_logp, grad_entropy = torch.autograd.grad(loss, [logp, entropy], allow_unused=True)
    return grad_logp, torch.zeros_like(entropy) if grad_entropy is None else grad_entropy


@pytest.mark.parametrize("loss_agg", AGGS)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_term_gradient_equals_estimator_derivative_times_aggregation_weight(loss_agg: str, estimator: str) -> None:
    data = _batch(1)
    data["adv"] = torch.zeros_like(data["adv"])  # isolates the KL term: the PPO term's gradient is 0 * ratio

    with contextlib.ExitStack() as stack:
        if estimator == "k1":  # penalises nothing in expectation (test_kl_expectations.py), so it warns
            stack.enter_context(pytest.warns(UserWarning, match="penalises nothing"))
        grad_logp, _ = _grads(data, loss_agg=loss_agg, kl_coef=0.3, kl_estimator=estimator)

    log_r = data["ref"] - data["logp"]
    derivative = {"k1": torch.ones_like(log_r), "k2": -log_r, "k3": 1 - log_r.exp()}[estimator]
    expected = 0.3 * derivative * _weights(data["mask"], loss_agg)
    torch.testing.assert_close(grad_logp, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_agg", AGGS)
def test_entropy_bonus_gradient_is_minus_coef_times_aggregation_weight_and_leaves_logp_alone(loss_agg: str) -> None:
    data = _batch(2)

    grad_with, grad_entropy = _grads(data, loss_agg=loss_agg, entropy_coef=0.05)
    grad_without, _ = _grads(data, loss_agg=loss_agg)

    torch.testing.assert_close(grad_entropy, -0.05 * _weights(data["mask"], loss_agg), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad_with, grad_without, rtol=0, atol=0)


@pytest.mark.parametrize("loss_agg", AGGS)
def test_token_ratio_gradient_per_token_is_minus_a_r_times_weight_where_unclipped(loss_agg: str) -> None:
    data = _batch(3)

    grad_logp, _ = _grads(data, loss_agg=loss_agg)

    expected = _pg_grad(data["logp"] - data["old"], data["adv"]) * _weights(data["mask"], loss_agg)
    assert bool((expected != 0).any()) and bool(((expected == 0) & data["mask"]).any())  # both branches occur
    torch.testing.assert_close(grad_logp, expected, rtol=1e-12, atol=1e-15)


def test_clip_boundaries_in_a_wide_batch_decide_each_token_separately() -> None:
    # Every row holds ratios just inside and just outside both clip bounds; advantages of both signs.
    delta = 1e-6
    log_ratios = [math.log(1 - LOW) - delta, math.log(1 - LOW) + delta, 0.0,
                  math.log(1 + HIGH) - delta, math.log(1 + HIGH) + delta, 0.9]  # fmt: skip
    log_ratio = torch.tensor([log_ratios] * 3, dtype=torch.float64)
    old = torch.full_like(log_ratio, -2.0)
    data = {"old": old, "logp": old + log_ratio, "ref": old, "entropy": torch.zeros_like(old),
            "adv": torch.tensor([1.5, -0.5, 2.0], dtype=torch.float64),
            "mask": torch.ones_like(old, dtype=torch.bool)}  # fmt: skip

    grad_logp, _ = _grads(data)

    n = log_ratio.numel()
    r = [math.exp(x) for x in log_ratios]
    # A > 0: gradient while r <= 1 + high; A < 0: while r >= 1 - low.
    expected = [
        [-1.5 * r[0] / n, -1.5 * r[1] / n, -1.5 * r[2] / n, -1.5 * r[3] / n, 0.0, 0.0],
        [0.0, 0.5 * r[1] / n, 0.5 * r[2] / n, 0.5 * r[3] / n, 0.5 * r[4] / n, 0.5 * r[5] / n],
        [-2.0 * r[0] / n, -2.0 * r[1] / n, -2.0 * r[2] / n, -2.0 * r[3] / n, 0.0, 0.0],
    ]
    torch.testing.assert_close(grad_logp, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_agg", AGGS)
def test_gspo_gradient_stops_at_sequence_ratio_so_each_token_gets_minus_a_s_times_weight(loss_agg: str) -> None:
    data = _batch(4)
    mask = data["mask"]

    grad_logp, _ = _grads(data, loss_agg=loss_agg, ratio_level="sequence")

    lengths = mask.sum(1).clamp(min=1)
    seq_log_ratio = torch.where(mask, data["logp"] - data["old"], 0.0).sum(1) / lengths
    # sg[s_i] * exp(logp - sg[logp]): value s_i on every token, d/dlogp_it = s_i (own token only); clipping is
    # decided per sequence.
    per_seq = _pg_grad(seq_log_ratio.unsqueeze(1), data["adv"]).expand_as(mask)
    expected = per_seq * _weights(mask, loss_agg)
    assert bool(((expected == 0) & (lengths > 0).unsqueeze(1) & mask).any())  # some sequence is clipped
    torch.testing.assert_close(grad_logp, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_agg", AGGS)
def test_extra_padding_columns_change_neither_loss_nor_gradient(loss_agg: str) -> None:
    # Dr. GRPO's denominator is max_len (the generation limit), not the padded width: padding a batch wider
    # (another micro-batch's width) must not rescale its loss.
    data = _batch(5)
    wide = {k: torch.cat([v, torch.full((v.shape[0], 4), -1.0, dtype=v.dtype)], 1) if v.dim() == 2 else v
            for k, v in data.items()}  # fmt: skip
    wide["mask"] = torch.cat([data["mask"], torch.zeros(6, 4, dtype=torch.bool)], 1)

    narrow_grad, _ = _grads(data, loss_agg=loss_agg, kl_coef=0.1, entropy_coef=0.01)
    wide_grad, _ = _grads(wide, loss_agg=loss_agg, kl_coef=0.1, entropy_coef=0.01)

    torch.testing.assert_close(wide_grad[:, :7], narrow_grad, rtol=1e-12, atol=1e-15)
    assert bool((wide_grad[:, 7:] == 0).all())


def test_seq_sum_fixed_len_divides_by_batch_times_max_len_not_width() -> None:
    data = _batch(6)
    logp = data["logp"].clone().requires_grad_(True)

    loss, _ = policy_loss(logp, data["old"], data["adv"], data["mask"], clip_eps_low=LOW, clip_eps_high=HIGH,
                          loss_agg="seq_sum_fixed_len", max_len=MAX_LEN)  # fmt: skip
    token_sum, _ = policy_loss(logp, data["old"], data["adv"], data["mask"], clip_eps_low=LOW, clip_eps_high=HIGH,
                               loss_agg="token_mean", num_tokens=1.0)  # fmt: skip

    torch.testing.assert_close(loss, token_sum / (6 * MAX_LEN), rtol=1e-12, atol=1e-15)


def test_importance_weight_scales_the_policy_gradient_and_receives_none() -> None:
    data = _batch(7)
    behaviour = (data["old"] - 0.3).requires_grad_(True)
    old = data["old"].clone().requires_grad_(True)
    adv = data["adv"].clone().requires_grad_(True)
    logp = data["logp"].clone().requires_grad_(True)

    loss, _ = policy_loss(logp, old, adv, data["mask"], clip_eps_low=LOW, clip_eps_high=HIGH,
                          behaviour_logprobs_B_C=behaviour)  # fmt: skip
    loss.backward()

    expected = math.exp(0.3) * _pg_grad(data["logp"] - data["old"], data["adv"]) * _weights(data["mask"], "token_mean")
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=1e-15)
    assert old.grad is None and behaviour.grad is None and adv.grad is None
