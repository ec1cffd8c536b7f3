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


# ------------------------------------------------------------------------------------------ constant groups

ESTIMATOR_CALLS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "grpo": lambda r, s: compute_advantages(r, s, "grpo", scale_by_std=True),
    "grpo_unscaled": lambda r, s: compute_advantages(r, s, "grpo", scale_by_std=False),
    "dr_grpo": lambda r, s: compute_advantages(r, s, "dr_grpo"),
    "rloo": lambda r, s: compute_advantages(r, s, "rloo"),
    "reinforce_pp": lambda r, s: compute_advantages(r, s, "reinforce_pp"),
    "reinforce_pp_baseline": lambda r, s: compute_advantages(r, s, "reinforce_pp_baseline"),
}
# Values whose float32 group mean is off by an ulp for some group size (0.7 x 16 is issue 23's example), values
# that are exact, large and negative ones, and partial-credit fractions (reverse_reward's k/6 times 0.5).
CONSTANTS = [0.7, 0.1, 0.3, 1 / 3, 0.9, 0.2, 1 / 12, 5 / 12, 0.05, 1e-3, 123.456, -0.3, 0.0, 1.0, 2.0**-20, 7e5]
GROUP_SIZES = [2, 3, 5, 7, 8, 12, 16, 24, 31, 64, 100]


@pytest.mark.parametrize("estimator", sorted(ESTIMATOR_CALLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_every_estimator_constant_groups_give_exactly_zero_for_many_constants_and_sizes(
    estimator: str, dtype: torch.dtype
) -> None:
    failures = []
    for group_size in GROUP_SIZES:
        for value in CONSTANTS:
            if dtype == torch.float16 and abs(value) > 6e4:
                continue  # not representable in float16
            rewards_B = torch.full((3 * group_size,), value, dtype=dtype)

            advantages_B = ESTIMATOR_CALLS[estimator](rewards_B, group_size)

            assert advantages_B.dtype == dtype
            if not bool((advantages_B == 0).all()):
                failures.append((group_size, value, advantages_B.abs().max().item()))
    assert not failures, f"non-zero advantages for constant groups (group_size, value, max |A|): {failures}"


def test_float32_issue_example_sixteen_0_7_gives_exactly_zero() -> None:
    rewards_B = torch.full((16,), 0.7)
    assert float(rewards_B.mean()) != float(rewards_B[0])  # the float32 mean really is off by an ulp

    assert bool((group_advantages(rewards_B, 16) == 0).all())
    assert bool((reinforce_pp_advantages(rewards_B, 16) == 0).all())
    assert bool((rloo_advantages(rewards_B, 16) == 0).all())


@pytest.mark.parametrize("estimator", ["grpo", "grpo_unscaled", "dr_grpo", "rloo", "reinforce_pp_baseline"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_estimators_constant_groups_among_varied_groups_give_exactly_zero(
    estimator: str, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(11)
    group_size = 16
    groups = []
    for index, value in enumerate(CONSTANTS[:8]):
        varied = torch.floor(torch.rand(group_size, generator=generator, dtype=torch.float64) * 6) / 12
        groups += [torch.full((group_size,), value, dtype=torch.float64), varied + index]
    rewards_B = torch.cat(groups).to(dtype)

    advantages_G_S = ESTIMATOR_CALLS[estimator](rewards_B, group_size).view(-1, group_size)

    constant_G = advantages_G_S.new_tensor([i % 2 == 0 for i in range(advantages_G_S.shape[0])]).bool()
    assert bool((advantages_G_S[constant_G] == 0).all())
    assert bool((advantages_G_S[~constant_G] != 0).any(dim=1).all())


def reference_advantages(rewards: list[float], group_size: int, estimator: str, eps: float = 1e-6) -> list[float]:
    """Every estimator with ``math.fsum`` statistics, in Python floats (exactly rounded sums)."""
    if estimator == "rloo":
        return reference_rloo(rewards, group_size)
    if estimator.startswith("reinforce_pp"):
        centred = list(rewards)
        if estimator == "reinforce_pp_baseline":
            centred = []
            for g in range(0, len(rewards), group_size):
                group = rewards[g : g + group_size]
                centred += [r - math.fsum(group) / len(group) for r in group]
        mean = math.fsum(centred) / len(centred)
        std = math.sqrt(math.fsum((c - mean) ** 2 for c in centred) / len(centred))
        return [(c - mean) / (std + eps) for c in centred]
    out: list[float] = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g : g + group_size]
        mean = math.fsum(group) / len(group)
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in group) / len(group))
        out += [(r - mean) / (std + eps) if estimator == "grpo" else r - mean for r in group]
    return out


@pytest.mark.parametrize("estimator", sorted(ESTIMATOR_CALLS))
def test_every_estimator_float32_random_rewards_equal_exact_reference_rounded_once(estimator: str) -> None:
    # Non-constant groups: the float64 statistics round the exact value once; the old float32 arithmetic was
    # within a few ulps of it, so results change by rounding only.
    rewards_B = torch.rand(8 * 16, generator=torch.Generator().manual_seed(5))
    name = "grpo" if estimator == "grpo" else "dr_grpo" if estimator.endswith("unscaled") else estimator

    advantages_B = ESTIMATOR_CALLS[estimator](rewards_B, 16)

    exact_B = torch.tensor(reference_advantages(rewards_B.double().tolist(), 16, name), dtype=torch.float64)
    torch.testing.assert_close(advantages_B, exact_B.float(), rtol=1.2e-7, atol=1e-12)
    float32_arithmetic_B = _float32_arithmetic(rewards_B, 16, name)
    torch.testing.assert_close(advantages_B, float32_arithmetic_B, rtol=1e-5, atol=1e-6)


def _float32_arithmetic(rewards_B: torch.Tensor, group_size: int, estimator: str) -> torch.Tensor:
    """The estimators as they were computed before statistics moved to float64 (rounding in float32)."""
    rewards_G_S = rewards_B.view(-1, group_size)
    if estimator == "rloo":
        return (rewards_G_S - (rewards_G_S.sum(1, keepdim=True) - rewards_G_S) / (group_size - 1)).reshape(-1)
    if estimator.startswith("reinforce_pp"):
        centred_B = rewards_B
        if estimator == "reinforce_pp_baseline":
            centred_B = (rewards_G_S - rewards_G_S.mean(1, keepdim=True)).reshape(-1)
        centred_B = centred_B - centred_B.mean()
        return centred_B / (centred_B.std(unbiased=False) + 1e-6)
    centred_G_S = rewards_G_S - rewards_G_S.mean(1, keepdim=True)
    if estimator == "grpo":
        centred_G_S = centred_G_S / (rewards_G_S.std(1, unbiased=False, keepdim=True) + 1e-6)
    return centred_G_S.reshape(-1)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimators_near_constant_float32_group_keep_true_signs_and_sizes(estimator: str) -> None:
    # Fifteen 0.7s and one 0.7 + 1 ulp: only the last sample is better. In float32 arithmetic the mean came out
    # one ulp BELOW 0.7, so every sample got a positive advantage (GRPO: +0.056 for the fifteen equal ones).
    value = torch.tensor(0.7)
    above = torch.nextafter(value, torch.tensor(1.0))
    rewards_B = torch.cat([value.repeat(15), above.view(1)])

    advantages_B = compute_advantages(rewards_B, 16, estimator)  # type: ignore[arg-type]

    exact_B = torch.tensor(reference_advantages(rewards_B.double().tolist(), 16, estimator), dtype=torch.float64)
    assert bool((advantages_B[:15] < 0).all()) and bool(advantages_B[15] > 0)
    torch.testing.assert_close(advantages_B, exact_B.float(), rtol=1.2e-7, atol=0)


def test_compute_advantages_grpo_scale_by_std_true_divides_by_population_std_plus_eps() -> None:
    rewards_B = torch.tensor([0.0, 0.5, 1.0, 1.0, 0.25, 0.25, 0.25, 0.75], dtype=torch.float64)

    scaled_B = compute_advantages(rewards_B, 4, "grpo", scale_by_std=True, eps=1e-3)
    unscaled_B = compute_advantages(rewards_B, 4, "grpo", scale_by_std=False, eps=1e-3)

    # group 1: mean 0.625, population std sqrt(0.171875); group 2: mean 0.375, std sqrt(0.046875)
    std_G = torch.tensor([math.sqrt(0.171875), math.sqrt(0.046875)], dtype=torch.float64)
    centred_B = rewards_B - torch.tensor([0.625, 0.375], dtype=torch.float64).repeat_interleave(4)
    torch.testing.assert_close(unscaled_B, centred_B, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(scaled_B, centred_B / (std_G + 1e-3).repeat_interleave(4), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_compute_advantages_gradient_wrt_rewards_matches_float64_formula(estimator: str) -> None:
    # Advantages are constants to the loss, but a reward model trained through them (or a detached-std mistake)
    # would see this Jacobian: the std's dependence on the rewards included.
    rewards_B = torch.rand(8, generator=torch.Generator().manual_seed(9), dtype=torch.float64).requires_grad_(True)
    weights_B = torch.randn(8, generator=torch.Generator().manual_seed(10), dtype=torch.float64)

    (grad_B,) = torch.autograd.grad((compute_advantages(rewards_B, 4, estimator) * weights_B).sum(), rewards_B)  # type: ignore[arg-type]

    def formula(r_B: torch.Tensor) -> torch.Tensor:
        r_G_S = r_B.view(-1, 4)
        if estimator == "rloo":
            return (r_G_S - (r_G_S.sum(1, keepdim=True) - r_G_S) / 3).reshape(-1)
        if estimator.startswith("reinforce_pp"):
            c_B = (r_G_S - r_G_S.mean(1, keepdim=True)).reshape(-1) if estimator.endswith("baseline") else r_B
            c_B = c_B - c_B.mean()
            return c_B / ((c_B * c_B).mean().sqrt() + 1e-6)
        c_G_S = r_G_S - r_G_S.mean(1, keepdim=True)
        if estimator == "grpo":
            c_G_S = c_G_S / ((c_G_S * c_G_S).mean(1, keepdim=True).sqrt() + 1e-6)
        return c_G_S.reshape(-1)

    (expected_B,) = torch.autograd.grad((formula(rewards_B) * weights_B).sum(), rewards_B)
    torch.testing.assert_close(grad_B, expected_B, rtol=1e-10, atol=1e-12)
