"""check_types: annotations resolved once per class; every instance is still checked and normalised."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from rlsdk.config import ConfigError
from rlsdk.config.validate import check_types


@dataclasses.dataclass(frozen=True)
class _Point:
    x: float
    tags: tuple[str, ...] = ()
    label: str | None = None

    def __post_init__(self) -> None:
        check_types(self)


def test_check_types_resolves_hints_once_per_class_and_checks_every_instance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[type] = []
    real = typing.get_type_hints

    def counting(obj: typing.Any, *args: typing.Any, **kwargs: typing.Any) -> dict[str, typing.Any]:
        calls.append(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(typing, "get_type_hints", counting)

    first = _Point(1, ["a"])
    second = _Point(2)
    with pytest.raises(ConfigError, match=r"_Point\.x"):
        _Point("3")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"_Point\.label"):
        _Point(4.0, label=5)  # type: ignore[arg-type]

    assert calls.count(_Point) <= 1
    assert (first.x, first.tags, type(first.x)) == (1.0, ("a",), float)
    assert (second.x, second.tags) == (2.0, ())
