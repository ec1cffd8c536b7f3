"""Advantage estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++) against plain-Python references."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from rlsdk.algorithms import compute_advantages, group_advantages, reinforce_pp_advantages, rloo_advantages


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


def reference_rloo(rewards: list[float], group_size: int) -> list[float]:
    out = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g : g + group_size]
        for i, r in enumerate(group):
            others = [x for j, x in enumerate(group) if j != i]
            out.append(r - sum(others) / len(others))
    return out


def reference_reinforce_pp(rewards: list[float], group_size: int, group_baseline: bool, eps: float) -> list[float]:
    centred = list(rewards)
    if group_baseline:
        centred = []
        for g in range(0, len(rewards), group_size):
            group = rewards[g : g + group_size]
            centred += [r - sum(group) / len(group) for r in group]
    mean = sum(centred) / len(centred)
    std = math.sqrt(sum((c - mean) ** 2 for c in centred) / len(centred))
    return [(c - mean) / (std + eps) for c in centred]


@pytest.mark.parametrize("group_size", [2, 3, 5])
def test_rloo_advantages_random_rewards_match_leave_one_out_loop(group_size: int) -> None:
    rewards_B = torch.rand(4 * group_size, generator=torch.Generator().manual_seed(group_size), dtype=torch.float64)

    advantages_B = rloo_advantages(rewards_B, group_size)

    expected = torch.tensor(reference_rloo(rewards_B.tolist(), group_size), dtype=torch.float64)
    torch.testing.assert_close(advantages_B, expected, rtol=1e-12, atol=1e-12)


def test_rloo_advantages_all_equal_group_gives_zero_and_group_size_1_raises() -> None:
    torch.testing.assert_close(rloo_advantages(torch.ones(6), 3), torch.zeros(6), rtol=0, atol=0)
    with pytest.raises(ValueError, match="group_size=1 is invalid for RLOO"):
        rloo_advantages(torch.ones(4), 1)


@pytest.mark.parametrize("group_baseline", [False, True])
@pytest.mark.parametrize("group_size", [1, 4])
def test_reinforce_pp_advantages_random_rewards_match_batch_normalised_loop(
    group_baseline: bool, group_size: int
) -> None:
    rewards_B = torch.rand(12, generator=torch.Generator().manual_seed(7), dtype=torch.float64)

    advantages_B = reinforce_pp_advantages(rewards_B, group_size, group_baseline=group_baseline, eps=1e-6)

    expected = reference_reinforce_pp(rewards_B.tolist(), group_size, group_baseline, 1e-6)
    torch.testing.assert_close(advantages_B, torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("group_baseline", [False, True])
def test_reinforce_pp_advantages_all_equal_rewards_give_zero(group_baseline: bool) -> None:
    advantages_B = reinforce_pp_advantages(torch.full((8,), 0.5), 4, group_baseline=group_baseline)

    torch.testing.assert_close(advantages_B, torch.zeros(8), rtol=0, atol=0)


def test_reinforce_pp_baseline_group_size_1_gives_zero() -> None:
    # Each sample is its own group: the group baseline removes everything.
    advantages_B = reinforce_pp_advantages(torch.rand(5), 1, group_baseline=True)

    torch.testing.assert_close(advantages_B, torch.zeros(5), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("grpo", lambda r: group_advantages(r, 4, scale_by_std=False)),
        ("dr_grpo", lambda r: group_advantages(r, 4, scale_by_std=False)),
        ("rloo", lambda r: rloo_advantages(r, 4)),
        ("reinforce_pp", lambda r: reinforce_pp_advantages(r, 4)),
        ("reinforce_pp_baseline", lambda r: reinforce_pp_advantages(r, 4, group_baseline=True)),
    ],
)
def test_compute_advantages_each_name_dispatches_to_its_estimator(estimator: str, expected: Callable) -> None:
    rewards_B = torch.rand(8, generator=torch.Generator().manual_seed(1))

    advantages_B = compute_advantages(rewards_B, 4, estimator, scale_by_std=False)  # type: ignore[arg-type]

    torch.testing.assert_close(advantages_B, expected(rewards_B), rtol=0, atol=0)


def test_compute_advantages_dr_grpo_ignores_scale_by_std_and_unknown_name_raises() -> None:
    rewards_B = torch.rand(8, generator=torch.Generator().manual_seed(2))

    torch.testing.assert_close(
        compute_advantages(rewards_B, 4, "dr_grpo", scale_by_std=True),
        group_advantages(rewards_B, 4, scale_by_std=False),
        rtol=0,
        atol=0,
    )
    with pytest.raises(ValueError, match="estimator='ppo' is invalid"):
        compute_advantages(rewards_B, 4, "ppo")  # type: ignore[arg-type]


@pytest.mark.parametrize("fn", [rloo_advantages, reinforce_pp_advantages])
def test_new_estimators_bad_shape_raises_value_error(fn: Callable) -> None:
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        fn(torch.zeros(6), 4)
    with pytest.raises(ValueError, match=r"rewards_B must be 1-D \[B\]"):
        fn(torch.zeros(2, 4), 4)
