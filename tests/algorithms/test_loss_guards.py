"""The loss's numerical guards at their edges, normaliser validation, empty batches and the k1 warning.

Expected values are written from the documented guards (rlsdk/algorithms/losses.py, docs/howto/algorithms.md) in
float64 Python arithmetic, one token at a time: the log-ratio clamped to +-20 before exp (no ratio gradient
beyond), k3 continued linearly above log_r = 20, dropped tokens removed, not multiplied by 0.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from rlsdk.algorithms import kl_penalty, policy_loss
from rlsdk.algorithms.losses import LOG_RATIO_LIMIT
from rlsdk.config import AlgorithmConfig

LOW, HIGH = 0.2, 0.28
EDGES = [-1e4, -89.0, -25.0, -20.0, -19.5, -0.3, 0.0, 0.1, 19.5, 20.0, 25.0, 80.0, 88.0, 89.0, 1e4]


def guarded_token(log_ratio: float, advantage: float) -> tuple[float, float]:
    """``(loss, d loss / d logp)`` of one token under the documented guard (float64 Python)."""
    clamped = min(max(log_ratio, -LOG_RATIO_LIMIT), LOG_RATIO_LIMIT)
    ratio = math.exp(clamped)
    surrogate, clipped = ratio * advantage, min(max(ratio, 1 - LOW), 1 + HIGH) * advantage
    inside = abs(log_ratio) <= LOG_RATIO_LIMIT
    # d(-min(.))/dlogp: -A * ratio through the unclipped branch when it is the (strictly) smaller one, or when
    # both are equal and the ratio is inside the clip range (torch.minimum splits ties; clamp passes its bounds).
    if surrogate < clipped or (surrogate == clipped and 1 - LOW < ratio < 1 + HIGH):
        grad = -advantage * ratio if inside else 0.0
    else:
        grad = 0.0
    return -min(surrogate, clipped), grad


def _loss(
    logprobs_B_C: torch.Tensor, old_B_C: torch.Tensor, advantages_B: torch.Tensor, mask_B_C: torch.Tensor, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    logprobs_B_C = logprobs_B_C.clone().requires_grad_(True)
    loss, metrics = policy_loss(
        logprobs_B_C, old_B_C, advantages_B, mask_B_C, clip_eps_low=LOW, clip_eps_high=HIGH, **kw
    )
    (grad_B_C,) = torch.autograd.grad(loss, logprobs_B_C)
    return loss.detach(), grad_B_C, metrics


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_policy_loss_log_ratio_edges_give_finite_guarded_loss_and_gradients(
    dtype: torch.dtype, ratio_level: str
) -> None:
    # One token per sequence (so the sequence ratio is the token's), both advantage signs, a second unmasked
    # garbage-free padded column to make the batch wider than one token.
    log_ratios = torch.tensor(EDGES + EDGES, dtype=torch.float64)
    advantages_B = torch.tensor([1.0] * len(EDGES) + [-1.0] * len(EDGES), dtype=dtype)
    logprobs_B_C = torch.stack([torch.full_like(log_ratios, -3.0), torch.full_like(log_ratios, -1.0)], 1)
    old_B_C = logprobs_B_C - torch.stack([log_ratios, torch.zeros_like(log_ratios)], 1)
    mask_B_C = torch.tensor([[True, False]] * len(log_ratios))

    loss, grad_B_C, metrics = _loss(
        logprobs_B_C.to(dtype), old_B_C.to(dtype), advantages_B, mask_B_C, ratio_level=ratio_level
    )

    expected = [guarded_token(lr, a) for lr, a in zip(log_ratios.tolist(), advantages_B.tolist())]
    n = len(expected)
    tol = {"rtol": 1e-12, "atol": 0.0} if dtype == torch.float64 else {"rtol": 2e-6, "atol": 0.0}
    assert torch.isfinite(loss) and bool(torch.isfinite(grad_B_C).all())
    torch.testing.assert_close(loss, torch.tensor(math.fsum(e[0] for e in expected) / n, dtype=dtype), **tol)
    expected_grad = torch.tensor([[e[1] / n, 0.0] for e in expected], dtype=dtype)
    torch.testing.assert_close(grad_B_C, expected_grad, **tol)
    beyond = sum(abs(lr) > LOG_RATIO_LIMIT for lr in log_ratios.tolist())
    torch.testing.assert_close(metrics["ratio_limited_tokens"], torch.tensor(float(beyond)), rtol=0, atol=0)
    assert torch.isfinite(metrics["ratio_sum"]) and torch.isfinite(metrics["loss_sum"])


def test_policy_loss_log_ratio_just_inside_limit_has_exact_unclipped_gradient() -> None:
    # A < 0 and ratio e^19.5: PPO's unclipped branch, gradient -A * ratio / N, exact (no guard engaged).
    logprobs_B_C = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    old_B_C = logprobs_B_C - torch.tensor([[19.5, 0.05]], dtype=torch.float64)

    loss, grad_B_C, metrics = _loss(logprobs_B_C, old_B_C, torch.tensor([-2.0], dtype=torch.float64),
                                    torch.ones(1, 2, dtype=torch.bool))  # fmt: skip

    ratios = [math.exp(19.5), math.exp(0.05)]
    torch.testing.assert_close(loss, torch.tensor(sum(2.0 * r for r in ratios) / 2, dtype=torch.float64))
    torch.testing.assert_close(grad_B_C, torch.tensor([[2.0 * r / 2 for r in ratios]], dtype=torch.float64))
    assert float(metrics["ratio_limited_tokens"]) == 0.0


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 1e30])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_policy_loss_non_finite_values_at_masked_positions_never_reach_loss_or_grad(
    value: float, ratio_level: str
) -> None:
    mask_B_C = torch.tensor([[True, True, False], [True, False, False]])
    logprobs_B_C = torch.tensor([[-1.0, -2.0, value], [-0.5, value, value]])
    old_B_C = torch.tensor([[-1.1, -1.9, -value], [-0.4, value, -value]])
    behaviour_B_C = torch.tensor([[-1.0, -2.0, value], [-0.5, -value, value]])
    ref_B_C = torch.tensor([[-1.2, -2.1, -value], [-0.6, value, -value]])
    clean_B_C = torch.where(mask_B_C, logprobs_B_C, -1.0)
    kw = {"ratio_level": ratio_level, "kl_coef": 0.1, "kl_estimator": "k3", "is_cap": 2.0, "is_cap_mode": "mask"}
    advantages_B = torch.tensor([1.0, -1.0])

    loss, grad_B_C, metrics = _loss(
        logprobs_B_C, old_B_C, advantages_B, mask_B_C, ref_logprobs_B_C=ref_B_C, behaviour_logprobs_B_C=behaviour_B_C,
        **kw,
    )  # fmt: skip
    clean_loss, clean_grad_B_C, _ = _loss(
        clean_B_C, torch.where(mask_B_C, old_B_C, -1.0), advantages_B, mask_B_C,
        ref_logprobs_B_C=torch.where(mask_B_C, ref_B_C, -1.0),
        behaviour_logprobs_B_C=torch.where(mask_B_C, behaviour_B_C, -1.0), **kw,
    )  # fmt: skip

    assert all(bool(torch.isfinite(v)) for v in metrics.values())
    torch.testing.assert_close(loss, clean_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad_B_C, clean_grad_B_C, rtol=0, atol=0)
    assert bool((grad_B_C[~mask_B_C] == 0).all())


@pytest.mark.parametrize("mean_log_ratio", [12.0, 19.9, 20.5, 30.0, 80.0, 89.0, 1e4, -1e4])
def test_gspo_sequence_ratio_edges_give_finite_loss_and_exact_or_zero_gradient(mean_log_ratio: float) -> None:
    # Row 0: three tokens whose log-ratios average to mean_log_ratio (advantage -1: PPO's unclipped branch for
    # large ratios). Row 1: an ordinary sequence whose loss and gradient must not be disturbed.
    spread = torch.tensor([0.5, -1.0, 0.5], dtype=torch.float32)
    log_ratio_B_C = torch.stack([mean_log_ratio + spread, torch.tensor([0.05, -0.02, 0.0])])
    logprobs_B_C = torch.full((2, 3), -2.0)
    old_B_C = logprobs_B_C - log_ratio_B_C
    advantages_B = torch.tensor([-1.0, 0.7])
    mask_B_C = torch.ones(2, 3, dtype=torch.bool)
    kw = {"ratio_level": "sequence", "loss_agg": "seq_mean_token_mean"}

    loss, grad_B_C, metrics = _loss(logprobs_B_C, old_B_C, advantages_B, mask_B_C, **kw)
    row1_loss, row1_grad_B_C, _ = _loss(logprobs_B_C[1:], old_B_C[1:], advantages_B[1:], mask_B_C[1:],
                                        num_sequences=2.0, **kw)  # fmt: skip

    seq_log_ratio = float((log_ratio_B_C[0].double()).mean())
    row0_loss, row0_grad = guarded_token(seq_log_ratio, -1.0)  # per token: s_i, its gradient s_i through each
    assert torch.isfinite(loss) and bool(torch.isfinite(grad_B_C).all())
    torch.testing.assert_close(loss, torch.tensor(row0_loss / 2) + row1_loss, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(grad_B_C[0], torch.full((3,), row0_grad / (3 * 2)), rtol=2e-6, atol=0)
    torch.testing.assert_close(grad_B_C[1:], row1_grad_B_C, rtol=1e-6, atol=1e-9)
    assert float(metrics["ratio_limited_tokens"]) == (3.0 if abs(seq_log_ratio) > LOG_RATIO_LIMIT else 0.0)


@pytest.mark.parametrize("log_r", [-1e4, -30.0, 0.3, 19.0, 20.0, 20.5, 25.0, 88.0, 89.0, 100.0, 1e4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_k3_beyond_overflow_is_linear_continuation_with_finite_restoring_gradient(
    log_r: float, dtype: torch.dtype
) -> None:
    logprobs_B_C = torch.full((1, 1), -50.0, dtype=torch.float64)
    ref_B_C = logprobs_B_C + log_r
    logprobs_B_C = logprobs_B_C.to(dtype).requires_grad_(True)

    kl_B_C = kl_penalty(logprobs_B_C, ref_B_C.to(dtype), "k3")
    (grad_B_C,) = torch.autograd.grad(kl_B_C.sum(), logprobs_B_C)

    x = float((ref_B_C.to(dtype) - logprobs_B_C.detach()).double())  # log_r as the dtype represents it
    limit = LOG_RATIO_LIMIT
    value = math.expm1(min(x, limit)) - min(x, limit) + math.expm1(limit) * max(x - limit, 0.0)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-6, "atol": 1e-6}
    torch.testing.assert_close(kl_B_C, torch.tensor([[value]], dtype=dtype), **tol)
    torch.testing.assert_close(grad_B_C, torch.tensor([[-math.expm1(min(x, limit))]], dtype=dtype), **tol)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_sum_fixed_len"])
def test_policy_loss_k3_with_ref_far_above_policy_keeps_loss_and_gradient_finite(loss_agg: str) -> None:
    logprobs_B_C = torch.tensor([[-100.0, -2.0], [-3.0, -1.0]])
    ref_B_C = torch.tensor([[-1.0, -2.1], [-3.0, 1e4]])  # ref - logp: 99 and 1e4 (exp overflows float32)

    loss, grad_B_C, metrics = _loss(
        logprobs_B_C, logprobs_B_C, torch.tensor([0.5, -0.5]), torch.ones(2, 2, dtype=torch.bool),
        loss_agg=loss_agg, max_len=3, kl_coef=0.01, kl_estimator="k3", ref_logprobs_B_C=ref_B_C,
    )  # fmt: skip

    assert torch.isfinite(loss) and torch.isfinite(metrics["kl_sum"]) and bool(torch.isfinite(grad_B_C).all())
    assert float(grad_B_C[0, 0]) < 0 and float(grad_B_C[1, 1]) < 0  # pulled up toward the reference


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_mask_mode_dropped_token_with_infinite_surrogate_leaves_loss_and_grad_of_the_rest(ratio_level: str) -> None:
    # Token 0 of row 0: importance weight e^3 > cap (dropped) and log-ratio 1e4, with a negative advantage so large
    # that e^20 * A overflows float32: the smaller (unclipped) branch is -inf, the token's loss +inf. It must drop
    # out exactly, not turn into 0 * inf = NaN.
    logprobs_B_C = torch.tensor([[-1.0, -2.0], [-1.5, -0.5]])
    old_B_C = logprobs_B_C - torch.tensor([[1e4, 0.05], [0.1, -0.1]])
    behaviour_B_C = old_B_C - torch.tensor([[3.0, 0.1], [0.0, -0.2]])
    advantages_B = torch.tensor([-1e30, 0.5])
    mask_B_C = torch.ones(2, 2, dtype=torch.bool)
    kw = {"behaviour_logprobs_B_C": behaviour_B_C, "is_cap": 2.0, "is_cap_mode": "mask", "num_tokens": 4.0}
    if ratio_level == "sequence":  # one token per sequence, so the dropped token's row holds only it
        logprobs_B_C, old_B_C, behaviour_B_C = (t.reshape(4, 1) for t in (logprobs_B_C, old_B_C, behaviour_B_C))
        advantages_B, mask_B_C = torch.tensor([-1e30, -1e30, 0.5, 0.5]), torch.ones(4, 1, dtype=torch.bool)
        kw["behaviour_logprobs_B_C"] = behaviour_B_C

    loss, grad_B_C, metrics = _loss(logprobs_B_C, old_B_C, advantages_B, mask_B_C, ratio_level=ratio_level, **kw)
    kept_B_C = mask_B_C.clone()
    kept_B_C.view(-1)[0] = False
    kept_loss, kept_grad_B_C, _ = _loss(logprobs_B_C, old_B_C, advantages_B, kept_B_C, ratio_level=ratio_level, **kw)

    assert float(metrics["is_capped_tokens"]) == 1.0
    assert torch.isfinite(loss) and bool(torch.isfinite(grad_B_C).all())
    torch.testing.assert_close(loss, kept_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad_B_C, kept_grad_B_C, rtol=0, atol=0)


@pytest.mark.parametrize("is_cap", [None, 2.0])
def test_importance_weight_log_beyond_limit_is_clamped_not_infinite(is_cap: float | None) -> None:
    logprobs_B_C = torch.tensor([[-1.0, -2.0]])
    behaviour_B_C = logprobs_B_C - torch.tensor([[1e4, 0.1]])  # old - behaviour: 1e4 (exp overflows)

    loss, grad_B_C, metrics = _loss(
        logprobs_B_C, logprobs_B_C, torch.tensor([0.5]), torch.ones(1, 2, dtype=torch.bool),
        behaviour_logprobs_B_C=behaviour_B_C, is_cap=is_cap,
    )  # fmt: skip

    weight0 = math.exp(LOG_RATIO_LIMIT) if is_cap is None else is_cap
    expected = [-0.5 * weight0, -0.5 * math.exp(0.1)]
    assert torch.isfinite(loss) and bool(torch.isfinite(grad_B_C).all())
    torch.testing.assert_close(loss, torch.tensor(sum(expected) / 2))
    torch.testing.assert_close(grad_B_C, torch.tensor([expected]) / 2)
    torch.testing.assert_close(metrics["is_weight_sum"], torch.tensor(weight0 + math.exp(0.1)))


# -------------------------------------------------------------------------------------------- normalisers


def _small_batch() -> tuple[torch.Tensor, ...]:
    logprobs_B_C = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], dtype=torch.float64)
    return logprobs_B_C, logprobs_B_C - 0.1, torch.tensor([1.0, -0.5], dtype=torch.float64), torch.ones(2, 2)


@pytest.mark.parametrize("name", ["num_tokens", "num_sequences"])
@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor(-4.0),
        torch.tensor(0.0),
        torch.tensor(float("nan")),
        torch.tensor(float("inf")),
        torch.tensor(-3),
        torch.tensor(True),
        -4.0,
        0,
        float("inf"),
        float("nan"),
    ],
    ids=repr,
)
def test_policy_loss_bad_normaliser_raises_value_error_naming_it(name: str, bad: Any) -> None:
    loss_agg = "token_mean" if name == "num_tokens" else "seq_mean_token_mean"

    with pytest.raises(ValueError, match=rf"^{name}\b.*(invalid|dtype)"):
        policy_loss(*_small_batch(), clip_eps_low=LOW, clip_eps_high=HIGH, loss_agg=loss_agg, **{name: bad})


@pytest.mark.parametrize(
    ("loss_agg", "name"),
    [("token_mean", "num_tokens"), ("seq_mean_token_mean", "num_sequences"), ("seq_sum_fixed_len", "num_sequences")],
)
def test_policy_loss_tensor_normaliser_equals_float_normaliser(loss_agg: str, name: str) -> None:
    kw = {"clip_eps_low": LOW, "clip_eps_high": HIGH, "loss_agg": loss_agg, "max_len": 3}

    as_float, _ = policy_loss(*_small_batch(), **kw, **{name: 6.0})
    as_int_tensor, _ = policy_loss(*_small_batch(), **kw, **{name: torch.tensor(6)})
    as_float_tensor, _ = policy_loss(*_small_batch(), **kw, **{name: torch.tensor(6.0, dtype=torch.float32)})

    torch.testing.assert_close(as_int_tensor, as_float, rtol=0, atol=0)
    torch.testing.assert_close(as_float_tensor, as_float, rtol=0, atol=0)


@pytest.mark.gpu
def test_policy_loss_bad_cuda_tensor_normaliser_raises_value_error_and_cuda_stays_usable() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: a 0-d normaliser tensor on the GPU")
    batch = tuple(t.cuda() for t in _small_batch())
    kw = {"clip_eps_low": LOW, "clip_eps_high": HIGH}

    with pytest.raises(ValueError, match=r"num_tokens=-4\.0 \(a 0-d tensor\) is invalid"):
        policy_loss(*batch, **kw, num_tokens=torch.tensor(-4.0, device="cuda"))
    good, _ = policy_loss(*batch, **kw, num_tokens=torch.tensor(4.0, device="cuda"))

    torch.testing.assert_close(good.cpu(), policy_loss(*_small_batch(), **kw)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_sum_fixed_len"])
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_policy_loss_empty_batch_gives_zero_loss_and_zero_gradient(loss_agg: str, shape: tuple[int, int]) -> None:
    logprobs_B_C = torch.zeros(shape, dtype=torch.float64)

    loss, grad_B_C, metrics = _loss(
        logprobs_B_C, logprobs_B_C, torch.zeros(shape[0], dtype=torch.float64), torch.ones(shape, dtype=torch.bool),
        loss_agg=loss_agg, max_len=4, kl_coef=0.1, ref_logprobs_B_C=logprobs_B_C,
    )  # fmt: skip

    torch.testing.assert_close(loss, torch.zeros((), dtype=torch.float64), rtol=0, atol=0)
    assert grad_B_C.shape == shape
    assert all(float(v) == 0.0 for v in metrics.values())


# ----------------------------------------------------------------------------------------------- k1 warning


@pytest.mark.parametrize(
    ("kl_coef", "kl_estimator", "warns"),
    [(0.1, "k1", True), (0.0, "k1", False), (0.1, "k2", False), (0.1, "k3", False)],
)
def test_policy_loss_k1_as_loss_term_warns_that_it_penalises_nothing(
    kl_coef: float, kl_estimator: str, warns: bool
) -> None:
    logprobs_B_C, old_B_C, advantages_B, mask_B_C = _small_batch()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy_loss(
            logprobs_B_C, old_B_C, advantages_B, mask_B_C, clip_eps_low=LOW, clip_eps_high=HIGH, kl_coef=kl_coef,
            kl_estimator=kl_estimator, ref_logprobs_B_C=old_B_C,  # type: ignore[arg-type]
        )  # fmt: skip

    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any("kl_estimator='k1'" in m and "penalises nothing" in m for m in messages) is warns


@pytest.mark.parametrize(
    ("kl_coef", "kl_estimator", "warns"),
    [(0.05, "k1", True), (0.0, "k1", False), (0.05, "k2", False), (0.05, "k3", False)],
)
def test_algorithm_config_k1_with_positive_kl_coef_warns_before_launch(
    kl_coef: float, kl_estimator: str, warns: bool
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AlgorithmConfig(kl_coef=kl_coef, kl_estimator=kl_estimator)  # type: ignore[arg-type]

    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any("AlgorithmConfig.kl_estimator='k1'" in m for m in messages) is warns
