"""Exact expectations of the KL estimators over a small categorical policy, by enumerating every token.

With samples ``y ~ pi_theta`` (the sampling distribution is the data, so it is held fixed: ``sg[pi(y)]``) and
``log_r = log ref(y) - log pi_theta(y)``, the loss adds ``E_y[k(y)]`` whose gradient is
``sum_y sg[pi(y)] grad k(y)``. Derivation (docs/howto/algorithms.md):

    k1 = -log_r:              E[grad k1] = sum_y pi grad log pi = grad sum_y pi = 0
    k2 = log_r^2 / 2:         E[grad k2] = sum_y pi (log pi - log ref) grad log pi = grad KL(pi || ref)
    k3 = e^log_r - log_r - 1: E[grad k3] = sum_y (pi - ref) grad log pi = -sum_y ref grad log pi
                                         = grad KL(ref || pi)
"""

from __future__ import annotations

import pytest
import torch

from rlsdk.algorithms import kl_penalty

VOCAB = 7


def _policies(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    theta_V = (torch.randn(VOCAB, generator=g, dtype=torch.float64) * 1.5).requires_grad_(True)
    ref_logprobs_V = torch.log_softmax(torch.randn(VOCAB, generator=g, dtype=torch.float64) * 1.5, dim=0)
    return theta_V, ref_logprobs_V


def _expectation(theta_V: torch.Tensor, ref_logprobs_V: torch.Tensor, estimator: str) -> torch.Tensor:
    logprobs_V = torch.log_softmax(theta_V, dim=0)
    kl_1_V = kl_penalty(logprobs_V.unsqueeze(0), ref_logprobs_V.unsqueeze(0), estimator)  # type: ignore[arg-type]
    return (logprobs_V.exp().detach() * kl_1_V.squeeze(0)).sum()


def _kl(p_logprobs_V: torch.Tensor, q_logprobs_V: torch.Tensor) -> torch.Tensor:
    return (p_logprobs_V.exp() * (p_logprobs_V - q_logprobs_V)).sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_estimators_expected_values_k1_k3_unbiased_k2_biased(seed: int) -> None:
    theta_V, ref_V = _policies(seed)
    forward_kl = _kl(torch.log_softmax(theta_V, 0), ref_V).detach()

    values = {k: _expectation(theta_V, ref_V, k).detach() for k in ("k1", "k2", "k3")}

    torch.testing.assert_close(values["k1"], forward_kl, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(values["k3"], forward_kl, rtol=1e-12, atol=1e-14)
    assert not torch.isclose(values["k2"], forward_kl, rtol=1e-3, atol=0)  # k2 is biased


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_estimators_expected_gradients_zero_forward_and_reverse_kl(seed: int) -> None:
    theta_V, ref_V = _policies(seed)

    (grad_k1_V,) = torch.autograd.grad(_expectation(theta_V, ref_V, "k1"), theta_V)
    (grad_k2_V,) = torch.autograd.grad(_expectation(theta_V, ref_V, "k2"), theta_V)
    (grad_k3_V,) = torch.autograd.grad(_expectation(theta_V, ref_V, "k3"), theta_V)
    (grad_forward_V,) = torch.autograd.grad(_kl(torch.log_softmax(theta_V, 0), ref_V), theta_V)
    (grad_reverse_V,) = torch.autograd.grad(_kl(ref_V, torch.log_softmax(theta_V, 0)), theta_V)

    torch.testing.assert_close(grad_k1_V, torch.zeros(VOCAB, dtype=torch.float64), rtol=0, atol=1e-14)
    torch.testing.assert_close(grad_k2_V, grad_forward_V, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_k3_V, grad_reverse_V, rtol=1e-12, atol=1e-14)
    # The two directions really differ here, so the checks above tell them apart.
    assert not torch.allclose(grad_forward_V, grad_reverse_V, rtol=1e-3, atol=1e-6)
