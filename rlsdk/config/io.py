"""Configs to and from plain mappings and YAML files, strictly: an unknown or misspelt key is an error.

Errors raised here name the field by its dotted path from the root config (``train.lr``), not by its class
(``TrainConfig.lr``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from rlsdk.config.deprecations import upgrade_mapping
from rlsdk.config.errors import ConfigError
from rlsdk.config.session import SessionConfig

T = TypeVar("T")


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (plain PyYAML keeps the last silently) and reads ``1e-3`` and
    ``1.0e3`` as floats (plain YAML 1.1 reads them as strings)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def config_from_dict(cls: type[T], data: Mapping[str, Any], *, path: str = "") -> T:
    """Build config class ``cls`` from a (possibly nested) mapping, as read from YAML.

    ``path`` is the dotted path of ``data`` from the root config, used in error messages. Nested sections may
    be mappings or already-built instances. Raises ConfigError for an unknown key (suggesting the closest
    valid one), a missing required field, a non-mapping section or any value the classes reject.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(path or cls.__name__, data, f"a mapping of {cls.__name__} fields")
    if not path:  # the root: deprecated keys (rlsdk.config.deprecations) move to their replacements, warning
        data = upgrade_mapping(cls, data)
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(_join(path, str(key)), value, _unknown_key_hint(str(key), names))
        tp = hints[key]
        if dataclasses.is_dataclass(tp) and not isinstance(value, tp):
            value = config_from_dict(tp, value, path=_join(path, key))
        kwargs[key] = value
    for f in fields:
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in kwargs:
            raise ConfigError(_join(path, f.name), _MISSING, f"a value: {f.name} is required")
    try:
        return cls(**kwargs)
    except ConfigError as err:
        prefix = f"{cls.__name__}."
        if not err.field.startswith(prefix):
            raise
        raise ConfigError(_join(path, err.field[len(prefix) :]), err.value, err.allowed) from None


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as nested dicts of YAML-safe values (tuples become lists); inverse of config_from_dict."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = config_to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def merge_overrides(cfg: T, overrides: Mapping[str, Any]) -> T:
    """A new config: ``cfg`` with ``overrides`` applied and every section validated again.

    Keys are dotted paths (``{"train.lr": 1e-4}``); a mapping value for a section is merged into that section
    key by key (``{"train": {"lr": 1e-4}}`` is the same override). ``cfg`` is not modified. Raises ConfigError
    for an unknown key, naming its dotted path and suggesting the closest valid key.
    """
    data = config_to_dict(cfg)
    _merge_into(data, upgrade_mapping(type(cfg), overrides), path="")
    return config_from_dict(type(cfg), data)


def load_config(path: str | Path, cls: type[T] = SessionConfig) -> T:  # type: ignore[assignment]
    """Read a YAML file into config class ``cls`` (strictly, as config_from_dict).

    Raises FileNotFoundError naming the path if there is no such file, and ConfigError naming the file and
    line for invalid YAML.
    """
    return config_from_dict(cls, read_yaml_mapping(path))


def save_config(cfg: Any, path: str | Path) -> None:
    """Write ``cfg`` as YAML to ``path`` (parent directories created), in field order."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file; an empty file is an empty mapping."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {p}")
    text = p.read_text()
    try:
        data = yaml.load(text, Loader=_YamlLoader)  # a SafeLoader: builds plain types only
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 0
        source = text.splitlines()[line - 1].strip() if 0 < line <= len(text.splitlines()) else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{p}:{line}", source, f"valid YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(p), data, "a YAML mapping of config sections at the top level")
    return data


def _merge_into(data: dict[str, Any], overrides: Mapping[str, Any], path: str) -> None:
    for dotted, value in overrides.items():
        node, node_path = data, path
        *parents, leaf = str(dotted).split(".")
        for key in parents:
            if key not in node:
                raise ConfigError(_join(node_path, key), value, _unknown_key_hint(key, list(node)))
            node_path = _join(node_path, key)
            if not isinstance(node[key], dict):
                raise ConfigError(node_path, node[key], "a config section to set keys in")
            node = node[key]
        if leaf not in node:
            raise ConfigError(_join(node_path, leaf), value, _unknown_key_hint(leaf, list(node)))
        if isinstance(node[leaf], dict) and isinstance(value, Mapping):
            _merge_into(node[leaf], value, _join(node_path, leaf))
        else:
            node[leaf] = value


def _unknown_key_hint(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    guess = f"; did you mean {close[0]!r}?" if close else ""
    return f"a known key (unknown key {key!r}{guess}); valid keys: {', '.join(valid)}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
