"""``moved_fields``: a field moved into a nested section keeps its old constructor keyword, attribute and positional
place, each warning, on any config dataclass (rlsdk's own moves are tested in test_moved_fields.py)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import pytest

from rlsdk.config import ConfigDeprecationWarning, ConfigError, config_from_dict
from rlsdk.config.aliases import moved_fields, moves_of
from rlsdk.config.deprecations import deprecations
from rlsdk.config.validate import check_types, require


@dataclass
class Backend:
    size: int = 1
    name: str = "x"

    def __post_init__(self) -> None:
        check_types(self)
        require(self, "size", self.size >= 1, "an int >= 1")


@moved_fields(remove_in="0.3", positional=("kind", "size", "name"), size="backend.size")
@dataclass
class Engine:
    kind: str = "a"
    name: str = "engine"
    backend: Backend = field(default_factory=Backend)


@dataclass
class Root:
    engine: Engine = field(default_factory=Engine)


def test_old_keyword_fills_the_section_and_warns_with_the_new_spelling_and_release() -> None:
    with pytest.warns(ConfigDeprecationWarning, match=r"Engine\(size=\.\.\.\).*Engine\(backend=Backend\(size=.*0\.3"):
        engine = Engine(size=3)

    assert engine.backend == Backend(size=3)


def test_old_attribute_forwards_reads_and_assignments_to_the_section() -> None:
    engine = Engine()

    with pytest.warns(ConfigDeprecationWarning, match=r"use Engine\.backend\.size instead"):
        engine.size = 5
    with pytest.warns(ConfigDeprecationWarning):
        assert engine.size == 5
    assert engine.backend.size == 5


def test_positional_arguments_follow_the_old_order_with_one_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = Engine("b", 4, "e2")

    assert (engine.kind, engine.backend.size, engine.name) == ("b", 4, "e2")
    assert len(caught) == 1 and "size -> backend.size, name" in str(caught[0].message)


def test_old_keyword_conflicting_with_the_section_raises_naming_both() -> None:
    with pytest.warns(ConfigDeprecationWarning), pytest.raises(ConfigError, match=r"'size' \(deprecated\) and backend"):
        Engine(size=2, backend=Backend(size=3))


def test_old_keyword_bad_value_is_checked_by_the_section_and_named_there() -> None:
    with pytest.warns(ConfigDeprecationWarning), pytest.raises(ConfigError) as info:
        Engine(size=0)

    assert info.value.field == "Engine.backend.size"


def test_old_mapping_key_loads_through_the_deprecation_registry() -> None:
    with pytest.warns(ConfigDeprecationWarning, match=r"'engine.size'.*'engine.backend.size'"):
        root = config_from_dict(Root, {"engine": {"size": 2}})

    assert root.engine.backend.size == 2
    assert [(d.old, d.new, d.remove_in) for d in deprecations(Root)] == [("engine.size", "engine.backend.size", "0.3")]
    assert [m.old for m in moves_of(Engine)] == ["size"]


@dataclass
class Section:
    size: int = 1


def test_moved_fields_declaration_naming_no_section_field_raises_type_error() -> None:
    with pytest.raises(TypeError, match="must move a non-field to a section field"):

        @moved_fields(remove_in="0.3", size="section.missing")
        @dataclass
        class Owner:
            section: Section = field(default_factory=Section)


def test_moved_fields_declaration_keeping_the_old_field_raises_type_error() -> None:
    with pytest.raises(TypeError, match="must move a non-field to a section field"):

        @moved_fields(remove_in="0.3", size="section.size")
        @dataclass
        class Owner:
            size: int = 1
            section: Section = field(default_factory=Section)


def test_moved_fields_bad_removal_release_raises_type_error() -> None:
    with pytest.raises(TypeError, match="release number"):
        moved_fields(remove_in="soon", size="section.size")
