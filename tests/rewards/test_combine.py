"""combine_rewards: weighted sums, per-component values for logging, sync and async components."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from rlsdk.engine.inference.sampling import left_pad
from rlsdk.rewards import (
    RewardBreakdown,
    RewardComponentError,
    RewardError,
    combine_rewards,
    compute_reward_breakdown,
    exact_match,
    format_match,
)
from rlsdk.workflow.rollout import Rollout


def ones(completions: list[str], **_: Any) -> list[float]:
    return [1.0] * len(completions)


async def lengths_async(completions: list[str], **_: Any) -> list[float]:
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def _rollout(completions: list[str], answers: list[str]) -> Rollout:
    batch = len(completions)
    prompt_ids_B_P, prompt_mask_B_P = left_pad([[1]] * batch, pad_token_id=0)
    return Rollout(
        rows=[{"prompt": f"p{i}", "answer": a} for i, a in enumerate(answers)],
        group_size=1,
        prompt_ids_B_P=prompt_ids_B_P,
        prompt_mask_B_P=prompt_mask_B_P,
        completion_ids_B_C=torch.ones(batch, 1, dtype=torch.long),
        completion_mask_B_C=torch.ones(batch, 1, dtype=torch.bool),
        logprobs_B_C=torch.zeros(batch, 1),
        versions_B_C=torch.zeros(batch, 1, dtype=torch.long),
        completions=completions,
    )


def test_combine_rewards_sync_components_weighted_sum_with_unweighted_components() -> None:
    reward = combine_rewards({"correct": (exact_match(), 1.0), "format": (format_match(r"^\d+$"), 0.25)})

    result = reward(["4", "five", "5"], answer=["4", "5", "4"], prompts=["a", "b", "c"])

    assert isinstance(result, RewardBreakdown)
    assert result == pytest.approx([1.25, 0.0, 0.25], abs=1e-12)
    assert result.components == {"correct": [1.0, 0.0, 0.0], "format": [1.0, 0.0, 1.0]}


def test_combine_rewards_with_async_component_is_async_and_sums() -> None:
    reward = combine_rewards({"one": (ones, -0.5), "length": (lengths_async, 2.0)})

    result = asyncio.run(reward(["ab", ""]))

    assert asyncio.iscoroutinefunction(reward)
    assert result == pytest.approx([3.5, -0.5], abs=1e-12)
    assert result.components == {"one": [1.0, 1.0], "length": [2.0, 0.0]}


def test_compute_reward_breakdown_combined_function_returns_component_tensors() -> None:
    rollout = _rollout(["4", "x"], ["4", "4"])
    reward = combine_rewards({"correct": (exact_match(), 2.0), "one": (ones, 1.0)})

    rewards_B, components = asyncio.run(compute_reward_breakdown(rollout, reward))

    torch.testing.assert_close(rewards_B, torch.tensor([3.0, 1.0]), rtol=0, atol=0)
    assert sorted(components) == ["correct", "one"]
    torch.testing.assert_close(components["correct"], torch.tensor([1.0, 0.0]), rtol=0, atol=0)


def test_compute_reward_breakdown_plain_function_has_no_components() -> None:
    _, components = asyncio.run(compute_reward_breakdown(_rollout(["a"], ["a"]), ones))

    assert components == {}


def test_combined_component_raising_names_component_in_reward_error() -> None:
    def broken(completions: list[str], **_: Any) -> list[float]:
        raise KeyError("numbers")

    reward = combine_rewards({"ok": (ones, 1.0), "countdown": (broken, 1.0)})

    with pytest.raises(RewardError, match=r"reward component 'countdown' \(.*broken\) raised KeyError"):
        asyncio.run(compute_reward_breakdown(_rollout(["a"], ["a"]), reward))


def test_combined_component_wrong_count_raises_value_error_naming_component() -> None:
    reward = combine_rewards({"short": (lambda completions, **_: [1.0], 1.0)})

    with pytest.raises(ValueError, match=r"reward component 'short' .* returned 1 rewards for 2 completions"):
        reward(["a", "b"])


def test_combined_async_component_raising_raises_component_error() -> None:
    async def broken(completions: list[str], **_: Any) -> list[float]:
        raise RuntimeError("judge down")

    reward = combine_rewards({"judge": (broken, 1.0)})

    with pytest.raises(RewardComponentError, match=r"'judge'.*judge down"):
        asyncio.run(reward(["a"]))


@pytest.mark.parametrize(
    ("components", "message"),
    [
        ({}, "at least one component"),
        ({"mean": (ones, 1.0)}, "name 'mean' is invalid"),
        ({"a/b": (ones, 1.0)}, "name 'a/b' is invalid"),
        ({"": (ones, 1.0)}, "name '' is invalid"),
        ({"x": (ones, math.inf)}, "weight inf"),
        ({"x": (ones, True)}, "weight True"),
        ({"x": ones}, r"allowed: a \(fn, weight\) tuple"),
        ({"x": ("ones", 1.0)}, "is not callable"),
    ],
)
def test_combine_rewards_bad_components_raise_value_error(components: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        combine_rewards(components)


def test_session_reward_combined_function_leaves_components_on_new_rollout_only(tmp_path: Any) -> None:
    from rlsdk import Session
    from rlsdk.config import ModelConfig, ObserveConfig, SessionConfig

    session = Session(SessionConfig(model=ModelConfig(path="unused"), observe=ObserveConfig(output_dir=str(tmp_path))))
    session.engine = object()  # type: ignore[assignment]  # reward() only checks that the session is open
    rollout = _rollout(["4", "x"], ["4", "4"])

    rewarded = asyncio.run(session.reward(rollout, combine_rewards({"correct": (exact_match(), 1.0)})))

    torch.testing.assert_close(rewarded.info["reward_components"]["correct"], torch.tensor([1.0, 0.0]))
    assert "reward_components" not in rollout.info
    assert rollout.rewards_B is None
