"""group_advantages against a plain-Python GRPO reference."""

from __future__ import annotations

import math

import pytest
import torch

from rlsdk.algorithms import group_advantages


def reference_group_advantages(rewards: list[float], group_size: int, scale_by_std: bool, eps: float) -> list[float]:
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        for r in group:
            out.append((r - mean) / (std + eps) if scale_by_std else r - mean)
    return out


@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("group_size", [1, 4, 16])
def test_group_advantages_random_rewards_match_python_reference(group_size: int, scale_by_std: bool) -> None:
    generator = torch.Generator().manual_seed(group_size)
    rewards_B = torch.rand(8 * group_size, generator=generator, dtype=torch.float64)

    advantages_B = group_advantages(rewards_B, group_size, scale_by_std=scale_by_std, eps=1e-6)

    expected_B = torch.tensor(
        reference_group_advantages(rewards_B.tolist(), group_size, scale_by_std, 1e-6), dtype=torch.float64
    )
    torch.testing.assert_close(advantages_B, expected_B, rtol=1e-10, atol=1e-12)


def test_group_advantages_constant_group_gives_zero() -> None:
    rewards_B = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])

    advantages_B = group_advantages(rewards_B, 4)

    torch.testing.assert_close(advantages_B[:4], torch.zeros(4), rtol=0, atol=0)
    torch.testing.assert_close(advantages_B[4:], torch.tensor([-1.0, 1.0, -1.0, 1.0]), rtol=1e-5, atol=1e-5)


def test_group_advantages_integer_rewards_return_float32() -> None:
    advantages_B = group_advantages(torch.tensor([0, 1, 1, 0]), 2, scale_by_std=False)

    assert advantages_B.dtype == torch.float32
    torch.testing.assert_close(advantages_B, torch.tensor([-0.5, 0.5, 0.5, -0.5]), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("rewards_B", "group_size", "match"),
    [
        (torch.zeros(6), 4, "not a multiple of group_size=4"),
        (torch.zeros(2, 4), 4, r"rewards_B must be 1-D \[B\], got shape \(2, 4\)"),
        (torch.zeros(4), 0, "group_size=0"),
    ],
)
def test_group_advantages_bad_input_raises_value_error(rewards_B: torch.Tensor, group_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards_B, group_size)
