"""grpo_loss against a plain-Python reference; shape checks; clipping; sharded token-mean reduction."""

from __future__ import annotations

import math

import pytest
import torch

from rlsdk.algorithms import grpo_loss


def reference_grpo_loss(
    logprobs: list[list[float]],
    old_logprobs: list[list[float]],
    advantages: list[float],
    mask: list[list[bool]],
    eps_low: float,
    eps_high: float,
    kl_coef: float = 0.0,
    ref_logprobs: list[list[float]] | None = None,
) -> tuple[float, int]:
    """Sum over masked tokens of the per-token loss, and the number of clipped tokens."""
    total, clipped = 0.0, 0
    for b, row in enumerate(logprobs):
        for t, logprob in enumerate(row):
            if not mask[b][t]:
                continue
            ratio = math.exp(logprob - old_logprobs[b][t])
            surrogate = ratio * advantages[b]
            clipped_surrogate = min(max(ratio, 1 - eps_low), 1 + eps_high) * advantages[b]
            clipped += clipped_surrogate < surrogate
            token = -min(surrogate, clipped_surrogate)
            if kl_coef > 0 and ref_logprobs is not None:
                delta = ref_logprobs[b][t] - logprob
                token += kl_coef * (math.exp(delta) - delta - 1)
            total += token
    return total, clipped


def _batch(batch: int = 6, width: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    old_B_C = -torch.rand(batch, width, generator=generator, dtype=torch.float64) * 3
    logprobs_B_C = old_B_C + torch.randn(batch, width, generator=generator, dtype=torch.float64) * 0.3
    lengths_B = torch.tensor([5, 3, 1, 4, 5, 2])[:batch]
    mask_B_C = torch.arange(width).unsqueeze(0) < lengths_B.unsqueeze(1)
    return {
        "logprobs_B_C": logprobs_B_C,
        "old_logprobs_B_C": old_B_C,
        "advantages_B": torch.randn(batch, generator=generator, dtype=torch.float64),
        "mask_B_C": mask_B_C,
        "ref_logprobs_B_C": old_B_C + torch.randn(batch, width, generator=generator, dtype=torch.float64) * 0.2,
    }


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_grpo_loss_random_batch_matches_python_reference(kl_coef: float) -> None:
    data = _batch()

    loss, metrics = grpo_loss(
        data["logprobs_B_C"],
        data["old_logprobs_B_C"],
        data["advantages_B"],
        data["mask_B_C"],
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        kl_coef=kl_coef,
        ref_logprobs_B_C=data["ref_logprobs_B_C"] if kl_coef > 0 else None,
    )

    expected_sum, expected_clipped = reference_grpo_loss(
        data["logprobs_B_C"].tolist(),
        data["old_logprobs_B_C"].tolist(),
        data["advantages_B"].tolist(),
        data["mask_B_C"].tolist(),
        0.2,
        0.28,
        kl_coef,
        data["ref_logprobs_B_C"].tolist(),
    )
    tokens = int(data["mask_B_C"].sum())
    torch.testing.assert_close(loss, torch.tensor(expected_sum / tokens, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(metrics["loss_sum"], torch.tensor(expected_sum), rtol=1e-6, atol=1e-6)
    assert expected_clipped > 0
    torch.testing.assert_close(metrics["clipped_tokens"], torch.tensor(float(expected_clipped)), rtol=0, atol=0)
    torch.testing.assert_close(metrics["tokens"], torch.tensor(float(tokens)), rtol=0, atol=0)
    assert all(value.dim() == 0 for value in metrics.values())


def test_grpo_loss_metrics_are_sums_over_masked_tokens() -> None:
    data = _batch()

    _, metrics = grpo_loss(
        data["logprobs_B_C"],
        data["old_logprobs_B_C"],
        data["advantages_B"],
        data["mask_B_C"],
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        kl_coef=0.0,
        ref_logprobs_B_C=data["ref_logprobs_B_C"],
    )

    mask = data["mask_B_C"]
    ratio = (data["logprobs_B_C"] - data["old_logprobs_B_C"]).exp()
    delta = data["ref_logprobs_B_C"] - data["logprobs_B_C"]
    kl = delta.exp() - delta - 1
    torch.testing.assert_close(metrics["ratio_sum"], ratio[mask].sum().float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(metrics["kl_sum"], kl[mask].sum().float(), rtol=1e-6, atol=1e-6)


def test_grpo_loss_masked_garbage_does_not_leak_into_loss_or_grad() -> None:
    data = _batch()
    logprobs_B_C = data["logprobs_B_C"].clone()
    logprobs_B_C[~data["mask_B_C"]] = float("nan")
    logprobs_B_C.requires_grad_(True)

    loss, _ = grpo_loss(
        logprobs_B_C,
        data["old_logprobs_B_C"],
        data["advantages_B"],
        data["mask_B_C"],
        clip_eps_low=0.2,
        clip_eps_high=0.2,
    )
    loss.backward()

    assert torch.isfinite(loss)
    assert logprobs_B_C.grad is not None
    assert torch.isfinite(logprobs_B_C.grad).all()
    assert (logprobs_B_C.grad[~data["mask_B_C"]] == 0).all()


@pytest.mark.parametrize(
    ("log_ratio", "advantage", "expect_clipped", "expect_grad"),
    [
        (math.log(1.2), 1.0, False, True),  # exactly at 1 + eps: the two terms are equal, not clipped
        (math.log(1.3), 1.0, True, False),  # above 1 + eps with A > 0: clipped, no gradient
        (math.log(1.3), -1.0, False, True),  # above 1 + eps with A < 0: the unclipped term is smaller
        (math.log(0.8), -1.0, False, True),  # exactly at 1 - eps
        (math.log(0.7), -1.0, True, False),  # below 1 - eps with A < 0: clipped
        (math.log(0.7), 1.0, False, True),  # below 1 - eps with A > 0: unclipped
    ],
)
def test_grpo_loss_ratio_at_and_beyond_clip_boundary_clips_only_outside(
    log_ratio: float, advantage: float, expect_clipped: bool, expect_grad: bool
) -> None:
    logprobs_B_C = torch.tensor([[log_ratio - 1.0]], dtype=torch.float64, requires_grad=True)
    old_B_C = torch.tensor([[-1.0]], dtype=torch.float64)

    loss, metrics = grpo_loss(
        logprobs_B_C,
        old_B_C,
        torch.tensor([advantage], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.bool),
        clip_eps_low=0.2,
        clip_eps_high=0.2,
    )
    loss.backward()

    ratio = math.exp(log_ratio)
    expected = -min(ratio * advantage, min(max(ratio, 0.8), 1.2) * advantage)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert bool(metrics["clipped_tokens"] == 1.0) is expect_clipped
    assert logprobs_B_C.grad is not None
    assert bool(logprobs_B_C.grad.abs().sum() > 0) is expect_grad


def test_grpo_loss_shards_normalised_by_global_tokens_sum_to_global_loss() -> None:
    data = _batch()
    logprobs_B_C = data["logprobs_B_C"].clone().requires_grad_(True)
    global_tokens = data["mask_B_C"].sum().double()
    kwargs = {"clip_eps_low": 0.2, "clip_eps_high": 0.2}

    global_loss, _ = grpo_loss(logprobs_B_C, data["old_logprobs_B_C"], data["advantages_B"], data["mask_B_C"], **kwargs)
    (global_grad,) = torch.autograd.grad(global_loss, logprobs_B_C)
    shard_losses = []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        loss, _ = grpo_loss(
            logprobs_B_C[rows],
            data["old_logprobs_B_C"][rows],
            data["advantages_B"][rows],
            data["mask_B_C"][rows],
            num_tokens=global_tokens,
            **kwargs,
        )
        shard_losses.append(loss)
    sharded_loss = torch.stack(shard_losses).sum()
    (sharded_grad,) = torch.autograd.grad(sharded_loss, logprobs_B_C)

    torch.testing.assert_close(sharded_loss, global_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sharded_grad, global_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", ["old_logprobs_B_C", "mask_B_C", "advantages_B", "ref_logprobs_B_C"])
def test_grpo_loss_mismatched_shape_raises_naming_tensor(bad: str) -> None:
    data = _batch()
    data[bad] = data[bad][:-1]

    with pytest.raises(ValueError, match=rf"{bad} has shape \(5"):
        grpo_loss(
            data["logprobs_B_C"],
            data["old_logprobs_B_C"],
            data["advantages_B"],
            data["mask_B_C"],
            clip_eps_low=0.2,
            clip_eps_high=0.2,
            kl_coef=0.1,
            ref_logprobs_B_C=data["ref_logprobs_B_C"],
        )


def test_grpo_loss_kl_without_reference_raises_value_error() -> None:
    data = _batch()

    with pytest.raises(ValueError, match="needs ref_logprobs_B_C"):
        grpo_loss(
            data["logprobs_B_C"],
            data["old_logprobs_B_C"],
            data["advantages_B"],
            data["mask_B_C"],
            clip_eps_low=0.2,
            clip_eps_high=0.2,
            kl_coef=0.1,
        )


def test_grpo_loss_empty_mask_gives_zero_loss() -> None:
    data = _batch()

    loss, metrics = grpo_loss(
        data["logprobs_B_C"],
        data["old_logprobs_B_C"],
        data["advantages_B"],
        torch.zeros_like(data["mask_B_C"]),
        clip_eps_low=0.2,
        clip_eps_high=0.2,
    )

    torch.testing.assert_close(loss, torch.zeros((), dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(metrics["tokens"], torch.tensor(0.0), rtol=0, atol=0)
