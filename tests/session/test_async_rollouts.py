"""rollout.mode='async': the next batch generates while the ranks train; staleness stays bounded; checkpoints
record the data position from before the batch in flight."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from rlsdk import Session, SessionConfig
from rlsdk.config import ConfigError, RolloutConfig
from rlsdk.rewards import reverse_reward

pytestmark = pytest.mark.distributed


def _async(config: SessionConfig, **rollout: Any) -> SessionConfig:
    fields = {"mode": "async", "max_staleness": 1, **rollout}
    return dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, **fields))


def test_async_rollouts_are_generated_during_the_update_and_are_at_most_one_version_behind(
    small_config: SessionConfig,
) -> None:
    async def scenario() -> list[dict[str, Any]]:
        steps = []
        async with await Session.start(_async(small_config)) as session:
            for _ in range(4):
                rollout = await session.reward(await session.rollout(), reverse_reward)
                in_flight = session._sampling.prefetch is not None and not session._sampling.prefetch.done()
                trainer = session.versions.trainer_version
                stats = await session.update(rollout)
                await session.sync_weights()
                steps.append(
                    {
                        "behaviour": sorted({int(v) for v in rollout.behaviour_versions_B}),
                        "trainer": trainer,
                        "next_in_flight_during_update": in_flight,
                        "dropped": stats["train/dropped_stale"],
                    }
                )
        return steps

    steps = asyncio.run(scenario())

    assert steps[0]["behaviour"] == [0] and steps[0]["trainer"] == 0
    for step in steps[1:]:
        assert step["trainer"] - min(step["behaviour"]) == 1  # generated while the previous update ran
    assert all(step["next_in_flight_during_update"] for step in steps)
    assert all(step["dropped"] == 0.0 for step in steps)


def test_async_checkpoint_records_the_data_position_before_the_batch_in_flight_so_resume_regenerates_it(
    small_config: SessionConfig,
) -> None:
    config = _async(small_config)

    async def original() -> tuple[list[str], str]:
        async with await Session.start(config) as session:
            rollout = await session.reward(await session.rollout(), reverse_reward)
            await session.update(rollout)
            await session.sync_weights()
            checkpoint = await session.save_checkpoint()  # the next batch is generating now
            in_flight = await session.rollout()
            return [row["prompt"] for row in in_flight.rows], str(checkpoint)

    prompts_in_flight, checkpoint = asyncio.run(original())
    resumed_config = dataclasses.replace(config, train=dataclasses.replace(config.train, resume_from=checkpoint))

    async def resumed() -> list[str]:
        async with await Session.start(resumed_config) as session:
            return [row["prompt"] for row in (await session.rollout()).rows]

    assert asyncio.run(resumed()) == prompts_in_flight


def test_async_mode_without_a_staleness_bound_is_refused_naming_max_staleness() -> None:
    with pytest.raises(ConfigError, match=r"max_staleness=0 .*mode='async'"):
        RolloutConfig(mode="async", max_staleness=0)


def test_dynamic_sampling_replaces_groups_with_equal_rewards_by_new_prompts_and_logs_the_rounds(
    small_config: SessionConfig,
) -> None:
    config = dataclasses.replace(
        small_config, rollout=dataclasses.replace(small_config.rollout, dynamic_sampling=True, max_sampling_rounds=3)
    )
    calls: list[int] = []

    def first_batch_uninformative(completions: list[str], **_: Any) -> list[float]:
        calls.append(len(completions))
        if len(calls) == 1:
            return [0.0] * len(completions)  # every group equal: no gradient, all dropped
        return [float(i % 2) for i in range(len(completions))]  # every group mixed

    async def scenario() -> tuple[Any, dict[str, float], list[str]]:
        async with await Session.start(config) as session:
            rollout = await session.rollout()
            rewarded = await session.reward(rollout, first_batch_uninformative)
            stats = await session.update(rewarded)
            return rewarded, stats, [row["prompt"] for row in rollout.rows]

    rewarded, stats, first_prompts = asyncio.run(scenario())

    assert len(rewarded.rows) == config.data.prompts_per_step
    assert not {row["prompt"] for row in rewarded.rows} & set(first_prompts)  # all replaced by new prompts
    assert calls == [config.data.prompts_per_step * config.rollout.group_size] * 2
    assert stats["dynamic_sampling/rounds"] == 2.0 and stats["dynamic_sampling/filled"] == 1.0
    assert stats["dynamic_sampling/dropped_groups"] == float(config.data.prompts_per_step)
