"""A real Session with inference.engine 'colocated': the gloo ranks generate with the weights they train."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import torch

from rlsdk import Session, SessionConfig
from rlsdk.config import ColocatedConfig
from rlsdk.rewards import reverse_reward

pytestmark = pytest.mark.distributed


def test_session_colocated_steps_generate_on_the_ranks_with_the_trained_version_and_verified_replicas(
    small_config: SessionConfig,
) -> None:
    # Arrange
    inference = dataclasses.replace(small_config.inference, engine="colocated")
    config = dataclasses.replace(small_config, inference=inference)

    async def scenario() -> dict[str, Any]:
        async with await Session.start(config) as session:  # the first sync checks both replicas hold v0
            out: dict[str, Any] = {"start": (session.versions.engine_version, session.versions.trainer_checksum)}
            first = await session.reward(await session.rollout(), reverse_reward)
            out["stats"] = await session.update(first)
            sent = session._run.broadcasts
            out["info"] = await session.sync_weights()  # verifies the checksums the update returned
            out["sync_commands"] = session._run.broadcasts - sent
            out["checksum"] = session.versions.trainer_checksum
            second = await session.rollout()
            out["versions"] = (first.versions_B_C, second.versions_B_C)
            out["masks"] = (first.completion_mask_B_C, second.completion_mask_B_C)
            out["rows"] = second.num_samples
            out["exported"] = await session.call("weight_info")
            await session.update(await session.reward(second, reverse_reward))
            await session.call("noop")  # a command after the update: the sync asks the ranks again
            sent = session._run.broadcasts
            out["info2"] = await session.sync_weights()
            out["sync2_commands"] = session._run.broadcasts - sent
            return out

    # Act
    out = asyncio.run(scenario())

    # Assert
    assert out["start"][0] == 0 and out["start"][1].startswith("xxh3:")
    assert out["stats"]["version/trainer"] == 1.0 and out["stats"]["train/tokens"] > 0
    # The ranks sampled with the very weights the update's forward used: same logprobs to float rounding.
    assert out["stats"]["agreement/logprob_absdiff_max"] < 1e-5
    assert (out["info"].version, out["info"].checksum) == (1, out["checksum"])
    assert out["checksum"] != out["start"][1]
    assert all(r["checksum"] == out["checksum"] and r["version"] == 1 for r in out["exported"])
    for versions, mask, version in zip(out["versions"], out["masks"], (0, 1)):
        assert (versions[mask] == version).all() and (versions[~mask] == -1).all()
    assert out["rows"] == config.data.prompts_per_step * config.rollout.group_size
    assert (out["sync_commands"], out["sync2_commands"], out["info2"].version) == (0, 1, 2)


def test_session_colocated_lookahead_samples_the_batches_as_without_and_skips_the_generate_command_across_evaluation(
    small_config: SessionConfig,
) -> None:
    # Arrange: the same run with inference.colocated.lookahead on and off
    def run(lookahead: bool) -> dict[str, Any]:
        inference = dataclasses.replace(
            small_config.inference, engine="colocated", colocated=ColocatedConfig(lookahead=lookahead)
        )
        observe = dataclasses.replace(small_config.observe, output_dir=f"{small_config.observe.output_dir}-{lookahead}")
        config = dataclasses.replace(small_config, inference=inference, observe=observe)

        async def scenario() -> dict[str, Any]:
            import json

            out: dict[str, Any] = {}
            async with await Session.start(config) as session:
                first = await session.rollout()
                await session.update(await session.reward(first, reverse_reward))
                await session.sync_weights()
                # a held-out evaluation between the update and the rollout leaves the look-ahead batch standing
                out["evaluation"] = await session.evaluate(None, reverse_reward)
                sent = session._run.broadcasts
                second = await session.rollout()  # with look-ahead: sampled inside the update command
                out["rollout_commands"] = session._run.broadcasts - sent
                await session.update(await session.reward(second, reverse_reward))
                checkpoint = await session.save_checkpoint()  # the look-ahead rows are not rolled out yet
                out["data_state"] = json.loads((checkpoint / "data_state.json").read_text())
                out["counters"] = json.loads((checkpoint / "session.json").read_text())
                explicit = await session.rollout(["12>", "345>"])  # takes the next seed: the held batch is void
                third = await session.rollout()
                await session.update(await session.reward(third, reverse_reward))
                out["next_rows"] = session.next_prompts()  # the rows the look-ahead drew
                out["batches"] = [
                    (r.completion_ids_B_C, r.logprobs_B_C, r.versions_B_C, [row["prompt"] for row in r.rows])
                    for r in (first, second, explicit, third)
                ]
                out["hits"] = session._engine().lookahead_hits  # type: ignore[attr-defined]
            return out

        return asyncio.run(scenario())

    # Act
    on, off = run(True), run(False)

    # Assert
    assert (on["rollout_commands"], off["rollout_commands"]) == (0, 1)
    assert (on["hits"], off["hits"]) == (1, 0)
    for (ids, logprobs, versions, prompts), (ids_off, logprobs_off, versions_off, prompts_off) in zip(
        on["batches"], off["batches"]
    ):
        assert prompts == prompts_off
        assert torch.equal(ids, ids_off) and torch.equal(versions, versions_off)
        torch.testing.assert_close(logprobs, logprobs_off, rtol=0, atol=0)
    assert on["data_state"] == off["data_state"] and on["counters"] == off["counters"]
    assert on["evaluation"]["eval/pass@1"] == off["evaluation"]["eval/pass@1"]
    assert on["next_rows"] == off["next_rows"]
