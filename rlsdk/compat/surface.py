"""The public surface as plain JSON-able data: config fields by dotted path, and API names with signatures.

The config walk (``config_fields``) also feeds the generated config reference in the docs, so the reference and
the guard always describe the same fields.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@dataclass(frozen=True)
class FieldInfo:
    """One config field: ``path`` is dotted from the root (``train.lr``); ``section`` marks a nested config."""

    path: str
    owner: type
    type: str
    required: bool
    default: Any
    choices: tuple[Any, ...] | None
    doc: str
    section: bool


def type_str(tp: Any) -> str:
    """Stable text for an annotation: ``float | None``, ``Literal['raise', 'drop']``, ``tuple[float, float]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "Literal[" + ", ".join(repr(a) for a in args) + "]"
    if origin in (Union, types.UnionType):
        return " | ".join(type_str(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(type_str(a) for a in args)}]"
    if tp is type(None):
        return "None"
    if tp is Ellipsis:
        return "..."
    return getattr(tp, "__name__", repr(tp))


def literal_choices(tp: Any) -> tuple[Any, ...] | None:
    """The Literal choices of ``tp`` (also inside ``X | None``); None if it has none."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    for arg in typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else ():
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg)
    return None


def attribute_docs(cls: type) -> dict[str, str]:
    """Field descriptions of config class ``cls``: the docstring right under each field
    (:func:`rlsdk.config.docs.field_docs`)."""
    from rlsdk.config.docs import field_docs

    return field_docs(cls)


def config_fields(root: type, prefix: str = "") -> list[FieldInfo]:
    """Every field of config dataclass ``root`` and of its nested config sections, depth first in field order."""
    hints = typing.get_type_hints(root)
    docs = attribute_docs(root)
    out: list[FieldInfo] = []
    for f in dataclasses.fields(root):
        if not f.init:
            continue
        tp, path = hints[f.name], f"{prefix}{f.name}"
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        section = dataclasses.is_dataclass(tp)
        default = None
        if not required and not section:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        info = FieldInfo(
            path, root, type_str(tp), required, default, literal_choices(tp), docs.get(f.name, ""), section
        )
        out.append(info)
        if section:
            out.extend(config_fields(tp, prefix=f"{path}."))
    return out


def config_schema(root: type | None = None) -> dict[str, Any]:
    """The config schema of ``root`` (default SessionConfig): fields by dotted path, and its deprecations."""
    from rlsdk.config.deprecations import deprecations
    from rlsdk.config.session import SessionConfig

    root = root or SessionConfig
    fields: dict[str, Any] = {}
    for info in config_fields(root):
        entry: dict[str, Any] = {"type": info.type}
        if info.required:
            entry["required"] = True
        elif info.section:
            entry["section"] = True
        else:
            entry["default"] = _jsonable(info.default)
        if info.choices is not None:
            entry["choices"] = list(info.choices)
        fields[info.path] = entry
    deps = {d.old: {"new": d.new, "remove_in": d.remove_in} for d in deprecations(root)}
    return {"root": root.__name__, "fields": fields, "deprecations": deps}


def api_surface(module: str = "rlsdk", config_root: type | None = None) -> dict[str, Any]:
    """Each name in ``module.__all__``: its kind, signature and parameters, and a class's public members.

    Config dataclasses (those reachable from ``config_root``, default SessionConfig) list methods only: their
    fields are guarded by the config schema, with its deprecations.
    """
    from rlsdk.config.session import SessionConfig

    mod = importlib.import_module(module)
    configs = {info.owner for info in config_fields(config_root or SessionConfig)} | {config_root or SessionConfig}
    return {name: _describe(getattr(mod, name), configs) for name in sorted(mod.__all__)}


def snapshot() -> dict[str, Any]:
    """The whole guarded surface: ``{"config": config_schema(), "api": api_surface()}``."""
    return {"config": config_schema(), "api": api_surface()}


def _describe(obj: Any, configs: set[type]) -> dict[str, Any]:
    if inspect.isclass(obj):
        entry: dict[str, Any] = {"kind": "config" if obj in configs else "class"}
        if obj not in configs:
            entry.update(_signature(obj))
        entry["members"] = _members(obj, skip_fields=obj in configs)
        return entry
    if callable(obj):
        return {"kind": "function", **_signature(obj)}
    return {"kind": "value", "type": type(obj).__name__}


def _members(cls: type, *, skip_fields: bool) -> dict[str, Any]:
    from rlsdk.config.aliases import moves_of

    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    if skip_fields:  # a config's moved-field aliases are guarded with its fields, as deprecations of the schema
        fields |= {move.old for move in moves_of(cls)}
    members: dict[str, Any] = {} if skip_fields else {name: {"kind": "field"} for name in sorted(fields)}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("rlsdk"):
            continue
        for name, raw in vars(klass).items():
            if name.startswith("_") or name in fields:
                continue
            if isinstance(raw, property):
                members[name] = {"kind": "property"}
            elif callable(raw) or isinstance(raw, (classmethod, staticmethod)):
                members[name] = {"kind": "method", **_signature(getattr(cls, name))}
            else:
                members[name] = {"kind": "attribute"}
    return dict(sorted(members.items()))


def _signature(obj: Any) -> dict[str, Any]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return {"signature": None, "params": []}
    # "name:KIND", with a trailing "=" when the parameter has a default
    params = [
        f"{p.name}:{p.kind.name}{'=' if p.default is not inspect.Parameter.empty else ''}"
        for p in sig.parameters.values()
    ]
    return {"signature": _ADDRESS.sub("", str(sig)), "params": params}


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)
