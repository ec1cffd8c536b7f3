"""train.resume_from: construction-time shape, and the checkpoint checks Session.start runs before any process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlsdk.config import ConfigError, LaunchConfig, ModelConfig, ObserveConfig, SessionConfig, TrainConfig
from rlsdk.engine.train.checkpoint import finalize_checkpoint, sign_checkpoint
from rlsdk.session import load_resume_state


def _config(output_dir: Path, resume_from: str | None, *, num_ranks: int = 2) -> SessionConfig:
    return SessionConfig(
        model=ModelConfig(path="models/tiny"),
        launch=LaunchConfig(num_ranks=num_ranks),
        train=TrainConfig(resume_from=resume_from),
        observe=ObserveConfig(output_dir=str(output_dir)),
    )


def _checkpoint(output_dir: Path, version: int) -> Path:
    """A checkpoint directory with the controller's files and a stand-in for the ranks' files."""
    root = output_dir / "checkpoints"
    tmp = root / f"step_{version}.tmp-test"
    (tmp / "model").mkdir(parents=True)
    (tmp / "model" / "config.json").write_text("{}", encoding="utf-8")
    (tmp / "trainer_state.pt").write_bytes(b"optimizer state")
    saved = {"launch": {"num_ranks": 2}, "train": {"parallelism": "ddp"}}
    extra = {
        "ledger.json": json.dumps({"trainer_version": version, "engine_version": version}),
        "config.yaml": yaml.safe_dump(saved),
        "data_state.json": json.dumps({"epoch": 0, "position": 4, "seed": 0, "num_rows": 64}),
        "session.json": json.dumps({"step": version, "rollouts": version}),
    }
    return finalize_checkpoint(tmp, root / f"step_{version}", extra)


def test_train_config_with_empty_resume_from_raises_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(resume_from="  ")

    assert info.value.field == "TrainConfig.resume_from"


def test_load_resume_state_without_resume_from_returns_none(tmp_path: Path) -> None:
    assert load_resume_state(_config(tmp_path, None)) is None


def test_load_resume_state_of_a_verified_checkpoint_returns_its_controller_state(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path, 3)

    directory, state = load_resume_state(_config(tmp_path, str(checkpoint)))

    assert directory == checkpoint
    assert state["ledger"]["trainer_version"] == 3
    assert state["data"]["position"] == 4
    assert state["session"] == {"step": 3, "rollouts": 3}


def test_load_resume_state_with_latest_picks_the_newest_complete_step_and_skips_partial_dirs(
    tmp_path: Path,
) -> None:
    _checkpoint(tmp_path, 2)
    newest = _checkpoint(tmp_path, 10)  # numeric order: step_10 is newer than step_2 and step_9
    (tmp_path / "checkpoints" / "step_12.tmp-0badc0de").mkdir()

    directory, _ = load_resume_state(_config(tmp_path, "latest"))

    assert directory == newest


def test_load_resume_state_with_latest_and_no_checkpoint_raises_config_error(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "step_1.tmp-0badc0de").mkdir(parents=True)

    with pytest.raises(ConfigError) as info:
        load_resume_state(_config(tmp_path, "latest"))

    assert info.value.field == "train.resume_from"
    assert "checkpoints" in str(info.value)


def test_load_resume_state_with_missing_directory_raises_config_error_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "checkpoints" / "step_7"

    with pytest.raises(ConfigError) as info:
        load_resume_state(_config(tmp_path, str(missing)))

    assert info.value.field == "train.resume_from"
    assert str(missing) in str(info.value)


def test_load_resume_state_of_a_directory_without_manifest_raises_config_error(tmp_path: Path) -> None:
    partial = tmp_path / "checkpoints" / "step_3.tmp-0badc0de"
    partial.mkdir(parents=True)

    with pytest.raises(ConfigError) as info:
        load_resume_state(_config(tmp_path, str(partial)))

    assert info.value.field == "train.resume_from"
    assert "manifest.json" in str(info.value)


@pytest.mark.parametrize("damage", ["modify", "delete"])
def test_load_resume_state_of_a_checkpoint_whose_file_does_not_match_its_manifest_raises_config_error(
    tmp_path: Path, damage: str
) -> None:
    checkpoint = _checkpoint(tmp_path, 3)
    if damage == "modify":
        (checkpoint / "trainer_state.pt").write_bytes(b"optimizer statf")
    else:
        (checkpoint / "trainer_state.pt").unlink()

    with pytest.raises(ConfigError) as info:
        load_resume_state(_config(tmp_path, str(checkpoint)))

    assert info.value.field == "train.resume_from"
    assert "trainer_state.pt" in str(info.value)


def test_load_resume_state_with_another_rank_count_raises_config_error_naming_num_ranks(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path, 3)

    with pytest.raises(ConfigError) as info:
        load_resume_state(_config(tmp_path, str(checkpoint), num_ranks=4))

    assert info.value.field == "launch.num_ranks"


def test_load_resume_state_of_a_checkpoint_without_session_json_returns_no_counters(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path, 3)
    (checkpoint / "session.json").unlink()  # written before session.json existed: not in its manifest
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["files"]["session.json"]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    sign_checkpoint(checkpoint)  # an older rlsdk's checkpoint, trusted by its user (`rlsdk checkpoint sign`)

    _, state = load_resume_state(_config(tmp_path, str(checkpoint)))

    assert state["session"] is None
