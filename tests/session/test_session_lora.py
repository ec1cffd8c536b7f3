"""LoRA runs through a real Session: adapters train on the ranks, syncs move only the adapter (verified by
checksum), checkpoints hold the adapter and resume exactly. The vLLM engine's half is in tests/engine/vllm."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import Any

import psutil
import pytest

from rlsdk import Session, SessionConfig
from rlsdk.config import ConfigError, InferenceConfig
from rlsdk.rewards import reverse_reward

pytestmark = pytest.mark.distributed
pytest.importorskip("peft", reason="LoRA needs peft: install the lora extra")


def _lora(config: SessionConfig) -> SessionConfig:
    return dataclasses.replace(config, train=dataclasses.replace(config.train, lora_rank=4, lora_alpha=8.0))


async def _steps(session: Session, count: int) -> list[dict[str, Any]]:
    records = []
    for _ in range(count):
        rollout = await session.reward(await session.rollout(), reverse_reward)
        stats = await session.update(rollout)
        info = await session.sync_weights()
        records.append(
            {
                "completions": rollout.completion_ids_B_C.tolist(),
                "loss": stats["train/loss"],
                "agreement": stats["agreement/logprob_absdiff_max"],
                "checksum": info.checksum,
                "sync_bytes": session.metrics.history[-1][1].get("sync/bytes") if session.metrics else None,
            }
        )
    return records


def test_session_lora_embedded_syncs_only_the_adapter_and_resumes_exactly(small_config: SessionConfig) -> None:
    from transformers import AutoModelForCausalLM

    config = _lora(small_config)

    async def run_a() -> tuple[list[dict[str, Any]], Path, str]:
        async with await Session.start(config) as session:
            await _steps(session, 2)
            checkpoint = await session.save_checkpoint()
            records = await _steps(session, 2)
            return records, checkpoint, (await session.call("weight_info"))[0]["checksum"]

    resumed_config = dataclasses.replace(config, train=dataclasses.replace(config.train, resume_from="latest"))

    async def run_b() -> list[dict[str, Any]]:
        async with await Session.start(resumed_config) as session:
            return await _steps(session, 2)

    original, checkpoint, trainer_checksum = asyncio.run(run_a())
    resumed = asyncio.run(run_b())

    base = AutoModelForCausalLM.from_pretrained(small_config.model.path)
    full_bytes = sum(t.numel() * t.element_size() for t in base.state_dict().values())
    linears = [m for m in base.model.layers.modules() if m.__class__.__name__ == "Linear"]
    adapter_bytes = sum(4 * (m.in_features + m.out_features) * 4 for m in linears)  # r=4, fp32
    assert all(r["sync_bytes"] == adapter_bytes for r in original) and adapter_bytes * 3 < full_bytes
    assert all(r["agreement"] < 1e-4 for r in original)  # the engine generates with base + the synced adapter
    assert sorted(p.name for p in (checkpoint / "model").iterdir() if "adapter" in p.name) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert not (checkpoint / "model" / "model.safetensors").exists()  # the base is model.path's, not copied
    assert trainer_checksum == original[-1]["checksum"]
    for got, want in zip(resumed, original, strict=True):
        assert got["completions"] == want["completions"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
        assert got["checksum"] == want["checksum"]  # bitwise the same adapter


def test_session_lora_colocated_ranks_generate_with_the_adapter_they_train_and_warn_once_of_the_frozen_head(
    small_config: SessionConfig,
) -> None:
    config = dataclasses.replace(_lora(small_config), inference=InferenceConfig(engine="colocated"))

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
        async with await Session.start(config) as session:
            records = await _steps(session, 2)
            shown = [r["message"] for r in session.log_router.recent_records() if r.get("level") == "WARNING"]
            return records, await session.call("weight_info"), shown

    records, ranks, shown = asyncio.run(run())

    assert ranks[0]["checksum"] == ranks[1]["checksum"] == records[-1]["checksum"]
    assert all(r["agreement"] < 1e-4 for r in records)
    # the tiny policy is randomly initialised: its frozen head caps every token's probability (docs/howto/lora.md)
    capped = [m for m in shown if "no token can get a probability above" in m]
    assert len(capped) == 1 and "train.lora_target_modules" in capped[0]
    logs = Path(config.observe.output_dir) / "logs"
    assert "no token can get a probability above" in (logs / "rank_0.log").read_text()
    assert "no token can get a probability above" not in (logs / "rank_1.log").read_text()


def test_session_resuming_a_lora_checkpoint_without_lora_raises_config_error_before_any_process(
    small_config: SessionConfig, tmp_path: Path
) -> None:
    import yaml

    from rlsdk.engine.train.checkpoint import finalize_checkpoint

    root = tmp_path / "out" / "checkpoints"
    saved = {"launch": {"num_ranks": 2}, "train": {"parallelism": "ddp", "lora_rank": 4}}
    extra = {"config.yaml": yaml.safe_dump(saved), "ledger.json": "{}", "data_state.json": "{}"}
    (root / "step_1.tmp-test").mkdir(parents=True)
    checkpoint = finalize_checkpoint(root / "step_1.tmp-test", root / "step_1", extra)  # signed with the user's key
    config = dataclasses.replace(
        small_config,
        train=dataclasses.replace(small_config.train, resume_from=str(checkpoint)),
        observe=dataclasses.replace(small_config.observe, output_dir=str(tmp_path / "out")),
    )
    children_before = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}

    with pytest.raises(ConfigError) as info:
        asyncio.run(Session.start(config))

    assert info.value.field == "train.lora_rank"
    assert {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)} <= children_before


def test_train_config_with_lora_and_fsdp2_raises_config_error_naming_parallelism() -> None:
    from rlsdk.config import TrainConfig

    with pytest.raises(ConfigError) as info:
        TrainConfig(lora_rank=8, parallelism="fsdp2")

    assert info.value.field == "TrainConfig.parallelism"


def test_session_lora_start_with_an_engine_on_other_base_weights_raises_weight_mismatch(
    small_config: SessionConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlsdk.data import build_tiny_policy
    from rlsdk.engine.inference.embedded import EmbeddedEngine
    from rlsdk.versioning import WeightMismatchError

    other = build_tiny_policy(tmp_path / "other-base", seed=1)  # same shapes, other weights
    load = EmbeddedEngine.from_pretrained.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        EmbeddedEngine, "from_pretrained", classmethod(lambda cls, path, **kwargs: load(cls, other, **kwargs))
    )

    with pytest.raises(WeightMismatchError, match="LoRA base weights differ"):
        asyncio.run(Session.start(_lora(small_config)))
