"""Reward application: sync and async functions, and one clear error per bad reward."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from rlsdk.engine.inference.sampling import left_pad
from rlsdk.rewards.apply import RewardError, compute_rewards
from rlsdk.workflow.rollout import Rollout


@pytest.fixture()
def rollout() -> Rollout:
    prompt_ids_B_P, prompt_mask_B_P = left_pad([[1, 2]] * 4, pad_token_id=0)
    return Rollout(
        rows=[{"prompt": "12>", "answer": "21"}, {"prompt": "34>", "answer": "43"}],
        group_size=2,
        prompt_ids_B_P=prompt_ids_B_P,
        prompt_mask_B_P=prompt_mask_B_P,
        completion_ids_B_C=torch.ones(4, 2, dtype=torch.long),
        completion_mask_B_C=torch.ones(4, 2, dtype=torch.bool),
        logprobs_B_C=torch.zeros(4, 2),
        versions_B_C=torch.zeros(4, 2, dtype=torch.long),
        completions=["21", "12", "43", "4"],
    )


def exact(completions: list[str], answer: list[str], **_: object) -> list[float]:
    return [float(c == a) for c, a in zip(completions, answer)]


async def exact_async(completions: list[str], answer: list[str], prompts: list[str]) -> list[float]:
    await asyncio.sleep(0)
    return [float(c == a) for c, a in zip(completions, answer)]


@pytest.mark.parametrize("fn", [exact, exact_async])
def test_compute_rewards_sync_and_async_functions_see_columns_per_sample(rollout: Rollout, fn: object) -> None:
    rewards_B = asyncio.run(compute_rewards(rollout, fn))

    torch.testing.assert_close(rewards_B, torch.tensor([1.0, 0.0, 1.0, 0.0]), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda completions, **_: [1.0], "returned 1 rewards for 4 samples"),
        (lambda completions, **_: [1.0, math.nan, 0.0, 0.0], "non-finite reward nan for sample 1"),
        (lambda completions, **_: 1 / 0, "raised ZeroDivisionError"),
        (lambda completions, **_: "abc", "allowed: a sequence of 4 numbers"),
    ],
)
def test_compute_rewards_bad_reward_raises_reward_error_naming_problem(
    rollout: Rollout, fn: object, message: str
) -> None:
    with pytest.raises(RewardError, match=message):
        asyncio.run(compute_rewards(rollout, fn))

    assert rollout.rewards_B is None


def test_compute_rewards_slow_function_times_out_with_clear_error(rollout: Rollout) -> None:
    async def slow(completions: list[str], **_: object) -> list[float]:
        await asyncio.sleep(5)
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"did not return within 0\.1 s"):
        asyncio.run(compute_rewards(rollout, slow, timeout_s=0.1))
