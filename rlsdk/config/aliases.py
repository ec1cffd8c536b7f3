"""Old Python spellings of config fields that moved into a nested section keep working, with a warning.

Moving a field into a per-backend section (``InferenceConfig.kv_cache_gib`` -> ``InferenceConfig.vllm.kv_cache_gib``)
is a rename. :func:`moved_fields` declares it once, on the class; from that declaration

- YAML keys, ``config_from_dict``/``merge_overrides`` keys and command-line flags are upgraded by the registry in
  ``rlsdk.config.deprecations`` (its ``deprecations(root)`` lists every move below ``root``), so the compatibility
  guard and the config reference show them too;
- the constructor keyword (``InferenceConfig(kv_cache_gib=2)``) puts its value into the section, whose own checks
  then run: the old key keeps its type and its constraints because it *is* the new field;
- the attribute (``cfg.kv_cache_gib``, read or assigned) is a property that forwards to the section.

Each use warns with :class:`~rlsdk.config.errors.ConfigDeprecationWarning` naming the new spelling and the release
that removes the old one. The old keyword together with a section that sets the same field to another value is a
ConfigError: one of the two would be silently lost. (A section whose field holds its default counts as not setting
it: a built dataclass cannot tell an explicit default from an omitted one, so the old keyword's value goes there.)

Why a wrapper around the dataclass ``__init__`` and not ``InitVar`` aliases: an ``InitVar`` needs a sentinel default
(``int | None`` for an ``int`` field, a changed type), shows the old names in the signature next to the new ones,
and cannot keep the old positional order, which the wrapper does: ``positional`` names the parameters in their
order before the move, so ``InferenceConfig("embedded", 2)`` still means ``num_threads=2`` (with a warning past the
first parameter whose position changed) instead of silently setting whatever field is second now.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rlsdk.config.errors import ConfigDeprecationWarning, ConfigError

T = TypeVar("T")

_MOVES = "__rlsdk_moved_fields__"
_NOT_GIVEN = object()


@dataclass(frozen=True)
class MovedField:
    """Field ``old`` of a config class now lives at ``new`` (``section.field``, relative to the same class); the old
    name stops working in rlsdk ``remove_in``."""

    old: str
    new: str
    remove_in: str


def moved_fields(*, remove_in: str, positional: tuple[str, ...] = (), **moves: str) -> Callable[[type[T]], type[T]]:
    """Class decorator (above ``@dataclass``): each keyword ``old="section.field"`` keeps ``old`` working.

    ``positional``: the class's positional parameters in their order before the moves, old names included.
    Raises TypeError at class definition when a move does not name a field of a nested config section, or the old
    name is still a field.
    """
    if not all(part.isdigit() for part in remove_in.split(".")):
        raise TypeError(f"moved_fields: remove_in={remove_in!r} is not a release number like '0.3'")

    def decorate(cls: type[T]) -> type[T]:
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
        entries: dict[str, MovedField] = {}
        for old, new in moves.items():
            section, _, leaf = new.partition(".")
            target = hints.get(section)
            ok = target is not None and dataclasses.is_dataclass(target) and leaf in _field_names(target)
            if old in names or not ok:
                raise TypeError(
                    f"moved_fields: {cls.__name__}.{old} -> {new!r} must move a non-field to a section field"
                )
            entries[old] = MovedField(old=old, new=new, remove_in=remove_in)
            setattr(cls, old, _alias_property(cls.__name__, entries[old]))
        unknown = [name for name in positional if name not in names and name not in entries]
        if unknown:
            raise TypeError(f"moved_fields: positional names {unknown} of {cls.__name__} are neither fields nor moved")
        order = (*positional, *(name for name in names if name not in positional))
        stable = next((i for i, (a, b) in enumerate(zip(order, names)) if a != b), len(order))
        cls.__init__ = _wrap_init(cls, hints, entries, order, stable, remove_in)  # type: ignore[misc]
        setattr(cls, _MOVES, entries)
        return cls

    return decorate


def moves_of(cls: type) -> tuple[MovedField, ...]:
    """The fields moved out of config class ``cls`` by :func:`moved_fields`, in declaration order."""
    return tuple(getattr(cls, _MOVES, {}).values())


def _field_names(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _alias_property(owner: str, move: MovedField) -> property:
    section, _, leaf = move.new.partition(".")
    message = (
        f"{owner}.{move.old} is deprecated: use {owner}.{move.new} instead; {owner}.{move.old} will be removed in "
        f"rlsdk {move.remove_in}"
    )

    def fget(self: Any) -> Any:
        warnings.warn(message, ConfigDeprecationWarning, stacklevel=2)
        return getattr(getattr(self, section), leaf)

    def fset(self: Any, value: Any) -> None:
        warnings.warn(message, ConfigDeprecationWarning, stacklevel=2)
        setattr(getattr(self, section), leaf, value)

    return property(fget, fset, doc=f"Deprecated: ``{move.new}`` (this name is removed in rlsdk {move.remove_in}).")


def _wrap_init(
    cls: type,
    hints: dict[str, Any],
    moves: dict[str, MovedField],
    order: tuple[str, ...],
    stable: int,
    remove_in: str,
) -> Callable[..., None]:
    init = cls.__init__
    owner = cls.__name__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(order):
            raise TypeError(f"{owner}() takes at most {len(order)} positional arguments ({len(args)} given)")
        if len(args) > stable:  # one warning for the whole call, naming where each moved argument lives now
            shifted = [f"{name} -> {moves[name].new}" if name in moves else name for name in order[stable : len(args)]]
            warnings.warn(
                f"{owner}(...): positional arguments after {order[stable - 1]!r} follow the field order before "
                f"rlsdk moved fields into sections ({', '.join(shifted)}); pass them by keyword: that order will be "
                f"removed in rlsdk {remove_in}",
                ConfigDeprecationWarning,
                stacklevel=2,
            )
        for name, value in zip(order, args):
            if name in kwargs:
                raise TypeError(f"{owner}() got multiple values for argument {name!r}")
            kwargs[name] = value
        by_section: dict[str, dict[str, tuple[str, Any]]] = {}
        for old in [key for key in kwargs if key in moves]:
            section, _, leaf = moves[old].new.partition(".")
            if old not in order[: len(args)]:
                warnings.warn(
                    f"{owner}({old}=...) is deprecated: use {owner}({section}={hints[section].__name__}({leaf}=...)) "
                    f"instead; the keyword {old!r} will be removed in rlsdk {moves[old].remove_in}",
                    ConfigDeprecationWarning,
                    stacklevel=2,
                )
            by_section.setdefault(section, {})[leaf] = (old, kwargs.pop(old))
        for section, values in by_section.items():
            kwargs[section] = _fill_section(owner, section, hints[section], kwargs.get(section, _NOT_GIVEN), values)
        init(self, **kwargs)

    return __init__


def _fill_section(owner: str, section: str, section_cls: Any, given: Any, values: dict[str, tuple[str, Any]]) -> Any:
    """The ``section`` instance with the old keywords' ``values`` (leaf -> (old name, value)) set in it."""
    leaves = {leaf: value for leaf, (_, value) in values.items()}
    if given is not _NOT_GIVEN and not isinstance(given, section_cls):
        raise ConfigError(f"{owner}.{section}", given, f"a {section_cls.__name__} instance")
    if given is not _NOT_GIVEN:
        defaults = {f.name: _default(f) for f in dataclasses.fields(section_cls)}
        for leaf, (old, value) in values.items():
            current = getattr(given, leaf)
            if current != value and current != defaults[leaf]:
                raise ConfigError(
                    f"{owner}.{old}",
                    value,
                    f"only one of {old!r} (deprecated) and {section}.{leaf} (= {current!r}); set {section}.{leaf}",
                )
    try:
        return section_cls(**leaves) if given is _NOT_GIVEN else dataclasses.replace(given, **leaves)
    except ConfigError as err:  # name the field as the user reaches it: InferenceConfig.vllm.kv_cache_gib
        prefix = f"{section_cls.__name__}."
        if not err.field.startswith(prefix):
            raise
        raise ConfigError(f"{owner}.{section}.{err.field[len(prefix) :]}", err.value, err.allowed) from None


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _NOT_GIVEN
