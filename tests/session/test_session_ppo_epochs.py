"""Several optimizer steps per update through a real Session on the default task (reverse digits)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from rlsdk import Session, SessionConfig
from rlsdk.config import AlgorithmConfig
from rlsdk.rewards import reverse_reward

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("off_policy", ["none", "decoupled"])
def test_session_update_with_four_ppo_epochs_clips_and_publishes_one_version_per_update(
    small_config: SessionConfig, off_policy: str
) -> None:
    config = dataclasses.replace(
        small_config,
        train=dataclasses.replace(small_config.train, ppo_epochs=4, mini_batch_size=8),
        algorithm=AlgorithmConfig(off_policy=off_policy),
    )

    async def run() -> list[dict[str, float]]:
        records = []
        async with await Session.start(config) as session:
            for _ in range(3):
                rollout = await session.reward(await session.rollout(), reverse_reward)
                records.append(await session.update(rollout))
                await session.sync_weights()
        return records

    stats = asyncio.run(run())

    # 16 samples, mini-batches of 8: 2 per epoch, 4 epochs
    assert [s["train/optimizer_steps"] for s in stats] == [8.0, 8.0, 8.0]
    assert [s["version/trainer"] for s in stats] == [1.0, 2.0, 3.0]  # one published version per update
    assert max(s["train/clip_fraction"] for s in stats) > 0  # later steps move the ratio out of [0.8, 1.2]
    # the agreement metrics come from the proximal pass, on the weights the engine sampled with
    for s in stats:
        assert s["agreement/logprob_absdiff_max"] < 1e-4
        assert s["train/lr"] == pytest.approx(config.train.lr)
