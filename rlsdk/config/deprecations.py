"""Renamed, moved and removed config keys that keep loading, with a warning, until the release that removes them.

To rename ``train.learning_rate`` to ``train.lr``: rename the dataclass field, then register the old key below::

    deprecated_field(old="train.learning_rate", new="train.lr", remove_in="0.3")

To move a field into a nested section (``inference.kv_cache_gib`` -> ``inference.vllm.kv_cache_gib``): declare it on
the class with ``rlsdk.config.aliases.moved_fields``, which also keeps the Python keyword and attribute working;
``deprecations(root)`` lists every such move below ``root`` next to the entries registered here.

YAML files, ``config_from_dict``, ``merge_overrides`` and command-line flags (``--train.learning-rate``) then
accept the old key, move its value to the new one and warn with ``ConfigDeprecationWarning`` (a FutureWarning,
shown by default) naming the replacement and the removal version. ``new=None`` marks a key that was removed
with no replacement: its value is dropped with the same warning. Setting both the old and the new key is a
ConfigError. Keys are dotted paths from the root config class (``SessionConfig`` unless ``root`` says
otherwise). The compatibility guard (``python -m rlsdk.compat``) reads these deprecations: a field that disappears
without one fails the guard, and so does a deprecated key whose replacement has another type or default.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlsdk.config.aliases import moves_of
from rlsdk.config.errors import ConfigDeprecationWarning, ConfigError
from rlsdk.config.session import SessionConfig
from rlsdk.config.validate import field_types

__all__ = [
    "ConfigDeprecationWarning",
    "DeprecatedField",
    "deprecated_field",
    "deprecations",
    "upgrade_cli_args",
    "upgrade_mapping",
]


@dataclass(frozen=True)
class DeprecatedField:
    """One deprecated dotted key: ``old`` moves to ``new`` (None: dropped) and stops working in ``remove_in``."""

    old: str
    new: str | None
    remove_in: str

    def message(self) -> str:
        use = f"use {self.new!r} instead" if self.new else "it has no effect and no replacement; delete it"
        return f"config key {self.old!r} is deprecated: {use}; {self.old!r} will be removed in rlsdk {self.remove_in}"


_REGISTRY: dict[type, dict[str, DeprecatedField]] = {}


def deprecated_field(old: str, new: str | None, remove_in: str, *, root: type = SessionConfig) -> DeprecatedField:
    """Register the dotted key ``old`` of config class ``root`` as deprecated in favour of ``new``."""
    if not old or old == new or not all(part.isdigit() for part in remove_in.split(".")):
        raise ValueError(f"deprecated_field: bad entry old={old!r} new={new!r} remove_in={remove_in!r}")
    entry = DeprecatedField(old=old, new=new, remove_in=remove_in)
    _REGISTRY.setdefault(root, {})[old] = entry
    return entry


def deprecations(root: type = SessionConfig) -> list[DeprecatedField]:
    """The deprecations of ``root``: the registered ones in registration order, then the fields moved into
    nested sections (``moved_fields``) of ``root`` and of every section below it, depth first."""
    registered = dict(_REGISTRY.get(root, {}))
    for prefix, cls in _sections(root, ""):
        for move in moves_of(cls):
            old = prefix + move.old
            registered.setdefault(old, DeprecatedField(old=old, new=prefix + move.new, remove_in=move.remove_in))
    return list(registered.values())


def _sections(cls: type, prefix: str) -> list[tuple[str, type]]:
    """``(dotted prefix, class)`` of ``cls`` and of every nested config dataclass below it."""
    out = [(prefix, cls)]
    for name, tp in field_types(cls):
        if dataclasses.is_dataclass(tp):
            out += _sections(typing.cast(type, tp), f"{prefix}{name}.")
    return out


def upgrade_mapping(root: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``data`` (nested or dotted keys) with every deprecated key moved to its replacement, warning."""
    out = _copy(data)
    for dep in deprecations(root):
        found, value = _pop(out, dep.old)
        if not found:
            continue
        warnings.warn(dep.message(), ConfigDeprecationWarning, stacklevel=2)
        if dep.new is None:
            continue
        if _has(out, dep.new):
            raise ConfigError(dep.old, value, f"only one of {dep.old!r} (deprecated) and {dep.new!r}")
        _put(out, dep.new, value)
    return out


def upgrade_cli_args(root: type, args: Sequence[str]) -> list[str]:
    """``args`` with deprecated flags (``--train.learning-rate``, ``--train.no-old-flag``) renamed, warning.

    Raises ConfigError for a removed flag, or for an old flag given together with its replacement.
    """
    by_flag = {dep.old.replace("_", "-"): dep for dep in deprecations(root)}
    given = _flag_names(args)
    out: list[str] = []
    for arg in args:
        if arg == "--":
            out.append(arg)
            continue
        flag, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        section, _, leaf = flag.replace("_", "-").rpartition(".")
        negated = leaf.startswith("no-") and _join(section, leaf[3:]) in by_flag
        dep = by_flag.get(_join(section, leaf[3:] if negated else leaf))
        if dep is None:
            out.append(arg)
            continue
        warnings.warn(dep.message().replace("config key", "flag"), ConfigDeprecationWarning, stacklevel=2)
        if dep.new is None:
            raise ConfigError("--" + flag, value or None, f"no flag: {dep.message()}")
        if dep.new.replace("_", "-") in given:
            raise ConfigError("--" + flag, value or None, f"only one of --{dep.old} (deprecated) and --{dep.new}")
        new_section, _, new_leaf = dep.new.replace("_", "-").rpartition(".")
        out.append("--" + _join(new_section, ("no-" if negated else "") + new_leaf) + eq + value)
    return out


def _flag_names(args: Sequence[str]) -> set[str]:
    """The dotted names (``train.lr``, dashes for underscores) of the flags in ``args``, ``--no-`` forms included
    under their plain name; nothing after a bare ``--``."""
    names: set[str] = set()
    for arg in args:
        if arg == "--":
            break
        if arg.startswith("--"):
            section, _, leaf = arg[2:].partition("=")[0].replace("_", "-").rpartition(".")
            names.add(_join(section, leaf[3:] if leaf.startswith("no-") else leaf))
            names.add(_join(section, leaf))
    return names


def _join(section: str, leaf: str) -> str:
    return f"{section}.{leaf}" if section else leaf


def _copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def _pop(data: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    if dotted in data:  # a dotted override key, as merge_overrides takes
        return True, data.pop(dotted)
    *parents, leaf = dotted.split(".")
    node: Any = data
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict) and leaf in node:
        return True, node.pop(leaf)
    return False, None


def _has(data: dict[str, Any], dotted: str) -> bool:
    return _pop(_copy(data), dotted)[0]


def _put(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(dotted, value, f"section {key!r} as a mapping, not a built instance, to set {leaf!r}")
    node[leaf] = value


# Registered deprecations of SessionConfig keys, oldest first. Delete an entry in the release it names.
