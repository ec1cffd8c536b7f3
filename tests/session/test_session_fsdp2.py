"""A real Session with train.parallelism 'fsdp2': init, rollout -> reward -> update -> sync -> checkpoint."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from rlsdk import Session, SessionConfig
from rlsdk.rewards import reverse_reward

pytestmark = pytest.mark.distributed


def test_session_fsdp2_step_on_real_ranks_updates_syncs_verified_weights_and_checkpoints(
    small_config: SessionConfig,
) -> None:
    config = dataclasses.replace(small_config, train=dataclasses.replace(small_config.train, parallelism="fsdp2"))

    async def scenario() -> dict:
        async with await Session.start(config) as session:  # init checks the gathered v0 checksum
            rollout = await session.reward(await session.rollout(), reverse_reward)
            stats = await session.update(rollout)
            info = await session.sync_weights()  # raises WeightMismatchError unless the engine loads v1 exactly
            checkpoint = await session.save_checkpoint()
            return {"stats": stats, "synced": (info.version, info.checksum), "checkpoint": checkpoint,
                    "checksum": session.versions.trainer_checksum}  # fmt: skip

    out = asyncio.run(scenario())

    assert out["stats"]["version/trainer"] == 1.0 and out["stats"]["train/tokens"] > 0
    assert out["synced"] == (1, out["checksum"])
    assert out["stats"]["agreement/logprob_absdiff_max"] < 1e-4  # sharded forward vs the embedded engine
    manifest = json.loads((out["checkpoint"] / "manifest.json").read_text())["files"]
    assert {"model/config.json", "model/model.safetensors", "trainer_state.pt", "rng_rank1.pt"} <= set(manifest)
