"""Resume exactly: a new Session started from a checkpoint replays the steps the original run took after it."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from rlsdk import Session, SessionConfig
from rlsdk.config import ConfigError
from rlsdk.rewards import reverse_reward

pytestmark = pytest.mark.distributed


async def _steps(session: Session, count: int) -> list[dict[str, Any]]:
    """``count`` RL steps (rollout, reward, update, sync); what each produced."""
    records = []
    for _ in range(count):
        rollout = await session.rollout()
        rollout = await session.reward(rollout, reverse_reward)
        stats = await session.update(rollout)
        await session.sync_weights()
        records.append(
            {
                "completions": rollout.completion_ids_B_C.tolist(),
                "rewards": rollout.rewards_B.tolist(),
                "loss": stats["train/loss"],
                "grad_norm": stats["train/grad_norm"],
                "lr": stats["train/lr"],
                "versions": (session.versions.trainer_version, session.versions.engine_version),
                "checksum": session.versions.trainer_checksum,
            }
        )
    return records


# ddp_ppo: several optimizer steps per update and a warm-up + cosine schedule, which the checkpoint must carry.
TRAIN_VARIANTS: dict[str, dict[str, Any]] = {
    "ddp": {},
    "fsdp2": {"parallelism": "fsdp2"},
    "ddp_ppo": {"ppo_epochs": 2, "mini_batch_size": 8, "lr_scheduler": "cosine", "warmup_steps": 3, "max_steps": 6},
}


@pytest.mark.parametrize("variant", list(TRAIN_VARIANTS))
def test_session_resumed_from_latest_checkpoint_replays_the_original_runs_next_steps(
    small_config: SessionConfig, variant: str
) -> None:
    small_config = dataclasses.replace(
        small_config, train=dataclasses.replace(small_config.train, **TRAIN_VARIANTS[variant])
    )

    async def run_a() -> tuple[list[dict[str, Any]], Path]:
        async with await Session.start(small_config) as session:
            await _steps(session, 3)
            checkpoint = await session.save_checkpoint()
            return await _steps(session, 2), checkpoint

    resumed_config = dataclasses.replace(
        small_config, train=dataclasses.replace(small_config.train, resume_from="latest")
    )

    async def run_b() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        async with await Session.start(resumed_config) as session:
            start = {
                "resumed_from": session.resumed_from,
                "versions": (session.versions.trainer_version, session.versions.engine_version),
                "step": session.step,
            }
            return await _steps(session, 2), start

    t0 = time.perf_counter()
    original, checkpoint = asyncio.run(run_a())
    # A partial checkpoint of a later step (a save interrupted before its rename): 'latest' must skip it.
    partial = checkpoint.parent / "step_9.tmp-0badc0de"
    (partial / "model").mkdir(parents=True)
    (partial / "trainer_state.pt").write_bytes(b"truncated")
    resumed, start = asyncio.run(run_b())
    seconds = time.perf_counter() - t0

    assert start == {"resumed_from": checkpoint, "versions": (3, 3), "step": 3}
    assert [r["versions"] for r in resumed] == [(4, 4), (5, 5)] == [r["versions"] for r in original]
    for got, want in zip(resumed, original, strict=True):
        assert got["completions"] == want["completions"]  # same prompts, same seeds, same weights
        assert got["rewards"] == pytest.approx(want["rewards"], rel=1e-6, abs=0.0)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5, abs=1e-7)
        assert got["lr"] == want["lr"]
        # Bitwise: fp32 weights round-trip through safetensors, the optimizer state through torch.save.
        assert got["checksum"] == want["checksum"]
    assert seconds < 300


def test_session_start_resuming_from_a_missing_checkpoint_raises_config_error_before_any_process(
    small_config: SessionConfig, tmp_path: Path
) -> None:
    missing = tmp_path / "checkpoints" / "step_3"
    config = dataclasses.replace(small_config, train=dataclasses.replace(small_config.train, resume_from=str(missing)))
    children_before = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}

    with pytest.raises(ConfigError) as info:
        asyncio.run(Session.start(config))

    assert info.value.field == "train.resume_from"
    assert {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)} <= children_before


def _record_checksum(checkpoint: Path, checksum: str) -> None:
    """Rewrite the weights checksum a checkpoint recorded (and its manifest entry), as an older rlsdk wrote it."""
    import hashlib
    import json

    import torch

    from rlsdk.engine.train.checkpoint import sign_checkpoint

    state_path = checkpoint / "trainer_state.pt"
    state = torch.load(state_path, weights_only=False)
    state["checksum"] = checksum
    torch.save(state, state_path)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = state_path.read_bytes()
    manifest["files"]["trainer_state.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=1))
    sign_checkpoint(checkpoint)  # trusted by its user, as `rlsdk checkpoint sign` does


def test_session_resumes_checkpoints_with_legacy_sha256_and_blake3_checksums_and_rejects_a_wrong_one(
    small_config: SessionConfig,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rlsdk.engine.weights import state_dict_checksum

    async def save() -> Path:
        async with await Session.start(small_config) as session:
            await _steps(session, 1)
            return await session.save_checkpoint()

    checkpoint = asyncio.run(save())
    model = AutoModelForCausalLM.from_pretrained(checkpoint / "model", dtype=torch.float32)
    legacy = state_dict_checksum(model.state_dict(), "sha256")  # what rlsdk recorded before BLAKE3
    legacy_blake3 = state_dict_checksum(model.state_dict(), "blake3")  # ... and before XXH3
    resumed_config = dataclasses.replace(
        small_config, train=dataclasses.replace(small_config.train, resume_from=str(checkpoint))
    )

    async def resume() -> tuple[int, str]:
        async with await Session.start(resumed_config) as session:
            return session.versions.trainer_version, session.versions.trainer_checksum

    _record_checksum(checkpoint, legacy)
    version, checksum = asyncio.run(resume())
    _record_checksum(checkpoint, legacy_blake3)
    version_b, checksum_b = asyncio.run(resume())
    _record_checksum(checkpoint, "0" * 64)
    with pytest.raises(Exception, match="the checkpoint recorded 000000000000"):
        asyncio.run(resume())

    assert version == version_b == 1 and checksum.startswith("xxh3:") and checksum_b == checksum
