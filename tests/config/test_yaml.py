"""Strict YAML loading, saving and dotted overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlsdk.config import (
    ConfigError,
    ModelConfig,
    SessionConfig,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    merge_overrides,
    save_config,
)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_load_config_nested_sections_builds_session_config(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\n  path: models/tiny\ntrain:\n  lr: 3.0e-4\nrollout:\n  stale_policy: drop\n")

    cfg = load_config(path)

    assert cfg.model.path == "models/tiny"
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.rollout.stale_policy == "drop"


def test_load_config_unknown_key_suggests_closest_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\n  path: m\ntrain:\n  lrr: 0.1\n")

    with pytest.raises(ConfigError) as info:
        load_config(path)

    assert info.value.field == "train.lrr"
    assert "did you mean 'lr'?" in str(info.value)
    assert "weight_decay" in str(info.value)


def test_load_config_unknown_section_suggests_closest_section(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\n  path: m\ntrian:\n  lr: 0.1\n")

    with pytest.raises(ConfigError) as info:
        load_config(path)

    assert info.value.field == "trian"
    assert "did you mean 'train'?" in str(info.value)


def test_load_config_bad_nested_value_error_names_dotted_path(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\n  path: m\ntrain:\n  lr: -1.0\n")

    with pytest.raises(ConfigError) as info:
        load_config(path)

    assert info.value.field == "train.lr"
    assert str(info.value).startswith("train.lr=-1.0")


def test_load_config_missing_required_section_error_names_it(tmp_path: Path) -> None:
    path = _write(tmp_path, "train:\n  lr: 0.1\n")

    with pytest.raises(ConfigError) as info:
        load_config(path)

    assert info.value.field == "model"
    assert "required" in str(info.value)


def test_load_config_missing_required_field_error_names_dotted_path(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\n  dtype: bfloat16\n")

    with pytest.raises(ConfigError) as info:
        load_config(path)

    assert info.value.field == "model.path"


def test_load_config_scalar_where_section_expected_raises_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\n  path: m\ntrain: 0.1\n")

    with pytest.raises(ConfigError) as info:
        load_config(path)

    assert info.value.field == "train"
    assert "mapping" in str(info.value)


def test_load_config_betas_list_becomes_tuple(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\n  path: m\ntrain:\n  betas: [0.8, 0.95]\n")

    cfg = load_config(path)

    assert cfg.train.betas == (0.8, 0.95)


def test_load_config_exponent_without_dot_reads_as_float(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\n  path: m\ntrain:\n  lr: 3e-4\n")

    assert load_config(path).train.lr == pytest.approx(3e-4)


def test_load_config_missing_file_raises_file_not_found_naming_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"

    with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
        load_config(path)


def test_load_config_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\n  path: m\ntrain:\n  lr: [0.1\n  max_steps: 3\n")

    with pytest.raises(ConfigError) as info:
        load_config(path)

    assert info.value.field.startswith(str(path) + ":")
    assert int(info.value.field.rsplit(":", 1)[1]) >= 4


def test_load_config_duplicate_key_raises_error_naming_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "model:\n  path: m\ntrain:\n  lr: 0.1\ntrain:\n  max_steps: 3\n")

    with pytest.raises(ConfigError) as info:
        load_config(path)

    assert info.value.field == f"{path}:5"
    assert "duplicate key 'train'" in str(info.value)


def test_load_config_component_class_loads_a_section_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "lr: 0.01\nmax_steps: 5\n")

    cfg = load_config(path, TrainConfig)

    assert cfg == TrainConfig(lr=0.01, max_steps=5)


def test_save_config_then_load_config_round_trip_is_equal(tmp_path: Path) -> None:
    cfg = merge_overrides(
        SessionConfig(model=ModelConfig(path="models/tiny", dtype="bfloat16")),
        {"train.lr": 1e-6, "train.betas": (0.5, 0.9), "train.max_grad_norm": None, "rollout.top_k": 5},
    )
    path = tmp_path / "sub" / "saved.yaml"

    save_config(cfg, path)

    assert load_config(path) == cfg


def test_config_to_dict_tuples_become_lists() -> None:
    data = config_to_dict(SessionConfig(model=ModelConfig(path="m")))

    assert data["train"]["betas"] == [0.9, 0.999]
    assert config_from_dict(SessionConfig, data) == SessionConfig(model=ModelConfig(path="m"))


def test_merge_overrides_dotted_key_returns_new_config_and_keeps_original() -> None:
    cfg = SessionConfig(model=ModelConfig(path="m"))

    merged = merge_overrides(cfg, {"train.lr": 1e-4, "seed": 7, "rollout": {"group_size": 4}})

    assert merged.train.lr == pytest.approx(1e-4)
    assert merged.seed == 7
    assert merged.rollout.group_size == 4
    assert merged.rollout.max_new_tokens == cfg.rollout.max_new_tokens
    assert cfg.train.lr == pytest.approx(1e-3)


def test_merge_overrides_bad_value_runs_validation_again() -> None:
    cfg = SessionConfig(model=ModelConfig(path="m"))

    with pytest.raises(ConfigError) as info:
        merge_overrides(cfg, {"data.max_digits": 2})

    assert info.value.field == "data.max_digits"


def test_merge_overrides_unknown_dotted_key_suggests_closest_key() -> None:
    cfg = SessionConfig(model=ModelConfig(path="m"))

    with pytest.raises(ConfigError) as info:
        merge_overrides(cfg, {"rollout.temprature": 0.5})

    assert info.value.field == "rollout.temprature"
    assert "did you mean 'temperature'?" in str(info.value)


def test_merge_overrides_key_below_a_plain_field_raises_error() -> None:
    cfg = SessionConfig(model=ModelConfig(path="m"))

    with pytest.raises(ConfigError) as info:
        merge_overrides(cfg, {"seed.value": 1})

    assert info.value.field == "seed"
