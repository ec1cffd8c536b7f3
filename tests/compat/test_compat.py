"""The compatibility guard: the live surface against the committed snapshot, and renames on synthetic configs."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rlsdk.compat import compare, config_schema, snapshot
from rlsdk.compat.__main__ import main as compat_main
from rlsdk.config import deprecations
from rlsdk.config.aliases import moved_fields
from rlsdk.config.deprecations import ConfigDeprecationWarning, deprecated_field
from rlsdk.config.io import config_from_dict

SNAPSHOT = Path(__file__).parent / "snapshot.json"


@dataclass
class OldTrain:
    learning_rate: float = 1e-3
    steps: int = 10


@dataclass
class OldRoot:
    train: OldTrain = field(default_factory=OldTrain)


@dataclass
class NewTrain:
    lr: float = 1e-3
    steps: int = 10


@dataclass
class NewRoot:
    train: NewTrain = field(default_factory=NewTrain)


@dataclass
class FlatEngine:
    kind: str = "a"
    cache_gib: int = 1


@dataclass
class FlatEngineRoot:
    engine: FlatEngine = field(default_factory=FlatEngine)


@dataclass
class Backend:
    cache_gib: int = 1


@moved_fields(remove_in="0.3", cache_gib="backend.cache_gib")
@dataclass
class SectionedEngine:
    kind: str = "a"
    backend: Backend = field(default_factory=Backend)


@dataclass
class SectionedEngineRoot:
    engine: SectionedEngine = field(default_factory=SectionedEngine)


@dataclass
class FloatBackend:
    cache_gib: float = 1.0


@moved_fields(remove_in="0.3", cache_gib="backend.cache_gib")
@dataclass
class RetypedEngine:
    kind: str = "a"
    backend: FloatBackend = field(default_factory=FloatBackend)


@dataclass
class RetypedEngineRoot:
    engine: RetypedEngine = field(default_factory=RetypedEngine)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty deprecation registry for the test, so synthetic entries never leak."""
    monkeypatch.setattr(deprecations, "_REGISTRY", {})


def test_live_surface_against_committed_snapshot_has_no_incompatible_change() -> None:
    report = compare(json.loads(SNAPSHOT.read_text()), snapshot())

    assert report.ok, report.format()
    if report.additions:
        warnings.warn(report.format(), UserWarning, stacklevel=1)


def test_rename_without_deprecation_fails_naming_the_deprecation_helper(registry: None) -> None:
    old, new = {"config": config_schema(OldRoot)}, {"config": config_schema(NewRoot)}

    report = compare(old, new, version="0.1.0")

    assert not report.ok
    message = report.format()
    assert "'train.learning_rate'" in message
    assert 'deprecated_field(old="train.learning_rate", new="train.NEW_NAME", remove_in="0.3")' in message
    assert "rlsdk/config/deprecations.py" in message
    assert "python -m rlsdk.compat update" in message


def test_rename_with_deprecation_passes_and_old_key_loads_with_warning(registry: None) -> None:
    old = {"config": config_schema(OldRoot)}
    deprecated_field(old="train.learning_rate", new="train.lr", remove_in="0.3", root=NewRoot)

    report = compare(old, {"config": config_schema(NewRoot)}, version="0.1.0")
    with pytest.warns(ConfigDeprecationWarning, match=r"'train.learning_rate'.*'train.lr'.*0\.3"):
        cfg = config_from_dict(NewRoot, {"train": {"learning_rate": 0.5}})

    assert report.ok, report.format()
    assert cfg.train.lr == 0.5


def test_field_moved_into_a_section_is_reported_as_a_deprecation_not_a_removal() -> None:
    old, new = {"config": config_schema(FlatEngineRoot)}, {"config": config_schema(SectionedEngineRoot)}

    report = compare(old, new, version="0.1.0")

    assert report.ok, report.format()
    assert "config field 'engine.cache_gib' is now deprecated: use 'engine.backend.cache_gib', removed in 0.3" in (
        report.format()
    )
    moved = {"engine.cache_gib": {"new": "engine.backend.cache_gib", "remove_in": "0.3"}}
    assert new["config"]["deprecations"] == moved


def test_field_moved_into_a_section_with_another_type_fails() -> None:
    old, new = {"config": config_schema(FlatEngineRoot)}, {"config": config_schema(RetypedEngineRoot)}

    report = compare(old, new, version="0.1.0")

    assert not report.ok
    assert "'engine.cache_gib -> engine.backend.cache_gib' changed type int -> float" in report.format()


def test_live_moved_fields_against_their_flat_spelling_pass_the_guard_as_deprecations(tmp_path: Path) -> None:
    # Arrange: the live snapshot as it was before the moves: each moved field flat again, with its type and default
    live = snapshot()
    flat = json.loads(json.dumps(live))
    moved = flat["config"].pop("deprecations")
    assert {"inference.kv_cache_gib", "launch.slurm_partition", "launch.ray_address"} <= moved.keys()
    for old_key, dep in moved.items():
        flat["config"]["fields"][old_key] = flat["config"]["fields"].pop(dep["new"])
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps(flat))

    # Act
    report = compare(flat, live)
    rc = compat_main(["check", "--snapshot", str(path)])

    # Assert
    assert rc == 0 and report.ok, report.format()
    text = report.format()
    for old_key, dep in moved.items():
        assert f"config field {old_key!r} is now deprecated: use {dep['new']!r}, removed in 0.3" in text


def test_changed_field_type_fails_saying_never_change_a_type() -> None:
    old = {"config": {"fields": {"train.steps": {"type": "int", "default": 10}}}}
    new = {"config": {"fields": {"train.steps": {"type": "float", "default": 10.0}}}}

    report = compare(old, new, version="0.1.0")

    assert not report.ok
    assert "changed type int -> float" in report.format()


def test_literal_gaining_a_choice_is_an_addition_not_a_failure() -> None:
    old = {"config": {"fields": {"e": {"type": "Literal['a']", "default": "a", "choices": ["a"]}}}}
    new = {"config": {"fields": {"e": {"type": "Literal['a', 'b']", "default": "a", "choices": ["a", "b"]}}}}

    report = compare(old, new, version="0.1.0")

    assert report.ok
    assert "accepts new choices" in report.format()


def test_literal_losing_a_choice_fails() -> None:
    old = {"config": {"fields": {"e": {"type": "Literal['a', 'b']", "default": "a", "choices": ["a", "b"]}}}}
    new = {"config": {"fields": {"e": {"type": "Literal['a']", "default": "a", "choices": ["a"]}}}}

    assert not compare(old, new, version="0.1.0").ok


def test_deprecation_dropped_before_its_release_fails_and_after_passes() -> None:
    old = {"config": {"fields": {}, "deprecations": {"a.old": {"new": "a.new", "remove_in": "0.3"}}}}
    new = {"config": {"fields": {}, "deprecations": {}}}

    assert not compare(old, new, version="0.2.0").ok
    assert compare(old, new, version="0.3.0").ok


def test_removed_public_name_fails_and_new_name_is_an_addition() -> None:
    fn = {"kind": "function", "signature": "(x)", "params": ["x:POSITIONAL_OR_KEYWORD"]}

    removed = compare({"api": {"foo": fn}}, {"api": {}})
    added = compare({"api": {}}, {"api": {"foo": fn}})

    assert not removed.ok
    assert "rlsdk.foo was removed" in removed.format()
    assert added.ok
    assert "new public name rlsdk.foo" in added.format()


def test_new_required_parameter_fails_but_new_optional_parameter_passes() -> None:
    old = {"kind": "function", "signature": "(x)", "params": ["x:POSITIONAL_OR_KEYWORD"]}
    required = {**old, "signature": "(x, y)", "params": [*old["params"], "y:POSITIONAL_OR_KEYWORD"]}
    optional = {**old, "signature": "(x, *, y=1)", "params": [*old["params"], "y:KEYWORD_ONLY="]}

    assert not compare({"api": {"f": old}}, {"api": {"f": required}}).ok
    assert compare({"api": {"f": old}}, {"api": {"f": optional}}).ok


def test_compat_cli_update_then_check_exits_zero(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.json"

    update_rc = compat_main(["update", "--snapshot", str(path)])
    check_rc = compat_main(["check", "--snapshot", str(path)])

    assert (update_rc, check_rc) == (0, 0)
    assert "train.lr" in json.loads(path.read_text())["config"]["fields"]


def test_compat_cli_check_with_removed_field_exits_one(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.json"
    compat_main(["update", "--snapshot", str(path)])
    data = json.loads(path.read_text())
    data["config"]["fields"]["train.learning_rate"] = {"type": "float", "default": 0.001}
    path.write_text(json.dumps(data))

    assert compat_main(["check", "--snapshot", str(path)]) == 1
