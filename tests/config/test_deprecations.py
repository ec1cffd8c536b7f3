"""Deprecated config keys keep loading (dicts, YAML, merge_overrides, flags) with a warning naming the fix."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rlsdk.config import ConfigError, merge_overrides, parse_cli
from rlsdk.config import deprecations as deps
from rlsdk.config.deprecations import ConfigDeprecationWarning, deprecated_field
from rlsdk.config.io import config_from_dict, load_config


@dataclass
class Train:
    lr: float = 1e-3
    clip: bool = False


@dataclass
class Root:
    train: Train = field(default_factory=Train)
    seed: int = 0


@pytest.fixture(autouse=True)
def renamed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Root renamed train.learning_rate -> train.lr and train.clip_grads -> train.clip, and dropped train.old."""
    monkeypatch.setattr(deps, "_REGISTRY", {})
    deprecated_field(old="train.learning_rate", new="train.lr", remove_in="0.3", root=Root)
    deprecated_field(old="train.clip_grads", new="train.clip", remove_in="0.3", root=Root)
    deprecated_field(old="train.old", new=None, remove_in="0.3", root=Root)


def test_config_from_dict_old_key_moves_value_and_warns() -> None:
    with pytest.warns(ConfigDeprecationWarning, match=r"use 'train.lr' instead.*removed in rlsdk 0\.3"):
        cfg = config_from_dict(Root, {"train": {"learning_rate": 0.25}})

    assert cfg.train.lr == 0.25


def test_load_config_old_key_in_yaml_loads_with_warning(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  learning_rate: 0.5\n")

    with pytest.warns(ConfigDeprecationWarning):
        cfg = load_config(path, Root)

    assert cfg.train.lr == 0.5


def test_merge_overrides_dotted_old_key_applies_with_warning() -> None:
    with pytest.warns(ConfigDeprecationWarning):
        cfg = merge_overrides(Root(), {"train.learning_rate": 0.125})

    assert cfg.train.lr == 0.125


def test_removed_key_without_replacement_is_dropped_with_warning() -> None:
    with pytest.warns(ConfigDeprecationWarning, match="no replacement"):
        cfg = config_from_dict(Root, {"train": {"old": 1}})

    assert cfg == Root()


def test_old_and_new_key_together_raise_config_error() -> None:
    with pytest.warns(ConfigDeprecationWarning), pytest.raises(ConfigError, match="only one of"):
        config_from_dict(Root, {"train": {"learning_rate": 0.1, "lr": 0.2}})


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--train.learning-rate", "0.5"], Train(lr=0.5)),
        (["--train.learning_rate=0.5"], Train(lr=0.5)),
        (["--train.clip-grads"], Train(clip=True)),
        (["--train.no-clip-grads"], Train(clip=False)),
    ],
)
def test_parse_cli_old_flag_applies_with_warning(args: list[str], expected: Train) -> None:
    with pytest.warns(ConfigDeprecationWarning, match="flag 'train.learning_rate'|flag 'train.clip_grads'"):
        cfg = parse_cli(Root(), args)

    assert cfg.train == expected


def test_deprecated_field_bad_removal_version_raises() -> None:
    with pytest.raises(ValueError, match="remove_in"):
        deprecated_field(old="a.b", new="a.c", remove_in="soon", root=Root)
