"""A real Session: background accelerate ranks on gloo, the embedded engine, one full RL step."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import psutil
import pytest
import torch

from rlsdk import RankError, Session, SessionConfig, StaleRolloutError
from rlsdk.config import ConfigError, ModelConfig
from rlsdk.rewards import combine_rewards, reverse_reward

pytestmark = pytest.mark.distributed


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_session_step_on_real_ranks_publishes_and_syncs_versions_then_closes_cleanly(
    small_config: SessionConfig,
) -> None:
    async def scenario() -> dict:
        session = await Session.start(small_config)
        try:
            out: dict = {"pids": [info["pid"] for info in session.rank_info.values()]}
            out["start_versions"] = (session.versions.trainer_version, session.versions.engine_version)
            rollout = await session.rollout()
            out["rollout_versions"] = rollout.versions
            out["unrewarded_update"] = None
            try:
                await session.update(rollout)
            except ValueError as exc:
                out["unrewarded_update"] = str(exc)
            # one weighted component: the same rewards as reverse_reward, plus a reward/reverse metric
            rollout = await session.reward(rollout, combine_rewards({"reverse": (reverse_reward, 1.0)}))
            stats = await session.update(rollout)
            out["stats"] = stats
            out["after_update"] = (session.versions.trainer_version, session.versions.engine_version)
            info = await session.sync_weights()
            out["synced"] = (info.version, session.versions.trainer_checksum == info.checksum)
            out["noop"] = await session.call("noop")
            try:
                await session.update(rollout)  # generated at v0, trainer is at v1, max_staleness 0
            except StaleRolloutError as exc:
                out["stale"] = str(exc)
            out["checkpoint"] = await session.save_checkpoint()
            out["publish_dir"] = Path(session._run.publish_dir or "")
            out["published"] = sorted(p.name for p in out["publish_dir"].iterdir())
        finally:
            await session.close()
        return out

    out = asyncio.run(scenario())

    assert out["start_versions"] == (0, 0)
    assert out["rollout_versions"] == [0]
    assert "reward" in out["unrewarded_update"]
    assert out["after_update"] == (1, 0)
    assert out["synced"] == (1, True)
    assert "v1.safetensors" in out["published"] and not out["publish_dir"].exists()  # removed by close()
    assert out["noop"] == [{"rank": 0}, {"rank": 1}]
    assert "v1" in out["stale"] and "v0" in out["stale"]
    stats = out["stats"]
    assert stats["version/trainer"] == 1.0
    assert 0.0 <= stats["train/clip_fraction"] <= 1.0
    assert stats["train/tokens"] > 0
    assert stats["reward/reverse"] == pytest.approx(stats["reward/mean"], rel=0, abs=1e-6)
    assert stats["agreement/logprob_absdiff_max"] < 1e-4  # the ranks' logprobs vs the embedded engine's
    assert abs(stats["agreement/ratio_max"] - 1.0) < 1e-4 and stats["agreement/ratio_rms_dev"] < 1e-4
    assert stats["agreement/tokens"] == stats["train/tokens"]  # sequential: every row sampled by the trainer's v0
    assert stats["train/ratio_limited_fraction"] == 0.0  # the log-ratio guard never engaged
    output = Path(small_config.observe.output_dir)
    assert list((output / "tensorboard").glob("events.out.tfevents.*"))
    assert (output / "logs" / "rank_0.log").is_file() and (output / "logs" / "rank_1.log").is_file()
    checkpoint = out["checkpoint"]
    assert checkpoint.name == "step_1"
    manifest = json.loads((checkpoint / "manifest.json").read_text())["files"]
    assert {"model/config.json", "trainer_state.pt", "rng_rank0.pt", "rng_rank1.pt", "ledger.json"} <= set(manifest)
    assert not any(_alive(pid) for pid in out["pids"])


def test_session_rank_exception_surfaces_as_rank_error_with_remote_traceback(
    small_config: SessionConfig,
) -> None:
    async def scenario() -> tuple[RankError, list]:
        async with await Session.start(small_config) as session:
            with pytest.raises(RankError) as info:
                await session.call("raise", {"message": "boom from the rank"})
            still_works = await session.call("noop")
        return info.value, still_works

    error, still_works = asyncio.run(scenario())

    assert "boom from the rank" in str(error)
    assert error.rank in (0, 1)
    assert "Traceback" in str(error)
    assert still_works == [{"rank": 0}, {"rank": 1}]


def test_session_start_with_missing_model_dir_raises_config_error_before_any_process(
    small_config: SessionConfig, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-model"
    config = SessionConfig(model=ModelConfig(path=str(missing)), observe=small_config.observe)
    children_before = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}

    with pytest.raises(ConfigError) as info:
        asyncio.run(Session.start(config))

    assert info.value.field == "model.path"
    assert str(missing) in str(info.value)
    children_after = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    assert children_after <= children_before


def test_session_with_one_rank_runs_a_verified_step_and_leaves_no_process(small_config: SessionConfig) -> None:
    # accelerate refuses --multi_gpu with one process: a single rank runs through `accelerate launch --cpu`.
    import dataclasses

    from rlsdk.rewards import reverse_reward as reward

    config = dataclasses.replace(small_config, launch=dataclasses.replace(small_config.launch, num_ranks=1))

    async def scenario() -> tuple[int, dict, list[int], str]:
        async with await Session.start(config) as session:
            pids = [info["pid"] for info in session.rank_info.values()] + [session._run.launcher.proc.pid]
            await session.update(await session.reward(await session.rollout(), reward))
            info = await session.sync_weights()
            return info.version, dict(session.rank_info), pids, session._run.device_plan.device

    version, ranks, pids, device = asyncio.run(scenario())

    assert version == 1
    assert config.launch.device == "auto" and device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert list(ranks) == [0] and ranks[0]["world_size"] == 1
    assert not any(_alive(pid) for pid in pids)


def test_session_update_awaits_the_engines_prepare_train_hook_before_it_sends_the_update(
    small_config: SessionConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: record, at each prepare_train, how many commands the ranks were sent so far
    from rlsdk.engine.inference.embedded import EmbeddedEngine

    seen: list[int] = []
    session_ref: list[Session] = []

    async def prepare_train(self: EmbeddedEngine) -> None:
        await asyncio.sleep(0)  # a real await: the Session must not send the update meanwhile
        seen.append(session_ref[0]._run.broadcasts)

    monkeypatch.setattr(EmbeddedEngine, "prepare_train", prepare_train)

    async def scenario() -> tuple[int, int]:
        async with await Session.start(small_config) as session:
            session_ref.append(session)
            rollout = await session.reward(await session.rollout(), reverse_reward)
            before = session._run.broadcasts
            await session.update(rollout)
            return before, session._run.broadcasts

    # Act
    before, after = asyncio.run(scenario())

    # Assert: awaited once, before the update command went out
    assert seen == [before] and after == before + 1
