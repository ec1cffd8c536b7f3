"""Type checks shared by every config dataclass, and a one-line helper for range checks.

``check_types`` reads each field's annotation and checks (and where safe, normalises) the value:

- ``bool`` must be a bool; ``int`` must be an int and not a bool (``True`` is not a rank count).
- ``float`` accepts an int or a float, stores a float, and must be finite.
- ``Literal[...]`` must be one of the choices; ``X | None`` accepts None or an ``X``.
- ``tuple[A, B]`` accepts a tuple or a list (YAML has no tuples) of that length and stores a tuple;
  ``tuple[A, ...]`` accepts one of any length.
- A nested config dataclass must already be an instance of that class (``config_from_dict`` builds it from a
  mapping).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, Literal, Union

from rlsdk.config.errors import ConfigError


def check_types(cfg: Any) -> None:
    """Check every field of the dataclass instance ``cfg`` against its annotation; raises ConfigError."""
    cls = type(cfg)
    for name, tp in field_types(cls):
        value = getattr(cfg, name)
        checked = _check(value, tp, f"{cls.__name__}.{name}")
        if checked is not value:
            object.__setattr__(cfg, name, checked)


@functools.cache
def field_types(cls: type) -> tuple[tuple[str, Any], ...]:
    """``(name, resolved annotation)`` per dataclass field of ``cls``, resolved once per class.

    ``typing.get_type_hints`` evaluates every string annotation and walks the MRO; it dominated building a config.
    A class's fields and annotations are fixed once it is defined; a failed resolution raises and is not cached.
    """
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def require(cfg: Any, name: str, ok: bool, allowed: str) -> None:
    """Raise ConfigError for field ``name`` of ``cfg`` unless ``ok``; ``allowed`` says what would be valid."""
    if not ok:
        raise ConfigError(f"{type(cfg).__name__}.{name}", getattr(cfg, name), allowed)


def describe(tp: Any) -> str:
    """Human text for what a value of annotation ``tp`` may be, used in error messages."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join("None" if a is type(None) else describe(a) for a in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"a list of any length, each {describe(args[0])}"
    if origin is tuple:
        return f"a list of {len(args)} values: " + ", ".join(describe(a) for a in args)
    if tp is float:
        return "a finite float"
    if tp is int:
        return "an int"
    if tp is bool:
        return "a bool (true or false)"
    if tp is str:
        return "a string"
    if dataclasses.is_dataclass(tp):
        return f"a {tp.__name__} instance (config_from_dict builds one from a mapping)"
    return f"a {getattr(tp, '__name__', tp)}"


def _check(value: Any, tp: Any, field: str) -> Any:
    """Return ``value`` (normalised) if it matches ``tp``; raise ConfigError naming ``field`` otherwise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(value, arg, field)
            except ConfigError:
                pass
        raise ConfigError(field, value, describe(tp))
    if origin is Literal:
        # `type(value) is type(choice)` keeps True from matching a Literal[1] choice.
        if any(value == choice and type(value) is type(choice) for choice in args):
            return value
        raise ConfigError(field, value, describe(tp))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, (tuple, list)):
            raise ConfigError(field, value, describe(tp))
        try:
            return tuple(_check(v, args[0], field) for v in value)
        except ConfigError:
            raise ConfigError(field, value, describe(tp)) from None
    if origin is tuple:
        if not isinstance(value, (tuple, list)) or len(value) != len(args) or Ellipsis in args:
            raise ConfigError(field, value, describe(tp))
        try:
            return tuple(_check(v, a, field) for v, a in zip(value, args))
        except ConfigError:
            raise ConfigError(field, value, describe(tp)) from None
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise ConfigError(field, value, describe(tp))
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(field, value, describe(tp))
    if tp in (bool, str) or dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        raise ConfigError(field, value, describe(tp))
    raise TypeError(f"{field}: annotation {tp!r} is not supported by rlsdk.config.validate")
