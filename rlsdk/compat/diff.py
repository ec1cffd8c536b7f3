"""Compare a committed snapshot with the live surface: incompatible changes fail, additions are reported.

Incompatible: a config field removed, renamed or moved into a section without a deprecation (``deprecated_field``
or ``moved_fields``), a changed field type (a Literal gaining choices is fine), also across such a rename, a field
becoming required, a changed default, a deprecation dropped before its ``remove_in`` release; a public name, member
or parameter removed, a parameter moved or newly required.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_LITERAL = re.compile(r"Literal\[[^\]]*\]")
_UPDATE = "run `python -m rlsdk.compat update` (or `make compat`) and commit tests/compat/snapshot.json"


@dataclass
class CompatReport:
    """``incompatible`` changes fail the guard; ``additions`` only mean the snapshot should be updated."""

    incompatible: list[str] = field(default_factory=list)
    additions: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.incompatible

    def format(self) -> str:
        lines: list[str] = []
        if self.incompatible:
            lines.append(f"{len(self.incompatible)} incompatible change(s) to the public surface:")
            lines += [f"  - {item}" for item in self.incompatible]
        if self.additions:
            lines.append(f"{len(self.additions)} compatible change(s) not in the snapshot yet ({_UPDATE}):")
            lines += [f"  - {item}" for item in self.additions]
        return "\n".join(lines) or "the public surface matches the snapshot"


def compare(old: dict[str, Any], new: dict[str, Any], *, version: str | None = None) -> CompatReport:
    """Compare snapshots (``{"config": ..., "api": ...}``; either key may be absent) made by rlsdk.compat."""
    if version is None:
        from rlsdk import __version__ as version
    report = CompatReport()
    if "config" in old and "config" in new:
        _compare_config(old["config"], new["config"], version, report)
    if "api" in old and "api" in new:
        _compare_api(old["api"], new["api"], report)
    return report


def _next_removal(version: str) -> str:
    major, minor = (int(p) for p in version.split(".")[:2])
    return f"{major}.{minor + 2}"


def _removed_field_message(path: str, entry: dict[str, Any], version: str) -> str:
    section = path.rpartition(".")[0]
    new = f"{section}.NEW_NAME" if section else "NEW_NAME"
    return (
        f"config field {path!r} ({entry['type']}) was removed or renamed without a deprecation, so every YAML file "
        f"and flag that sets it now fails. Keep it loading: in rlsdk/config/deprecations.py add "
        f'`deprecated_field(old="{path}", new="{new}", remove_in="{_next_removal(version)}")` (new=None if it has '
        f"no replacement), then {_UPDATE}"
    )


def _compare_config(old: dict[str, Any], new: dict[str, Any], version: str, report: CompatReport) -> None:
    old_fields, new_fields = old["fields"], new["fields"]
    old_deps, new_deps = old.get("deprecations", {}), new.get("deprecations", {})
    for path, entry in old_fields.items():
        live = new_fields.get(path)
        if live is None:
            if path in new_deps or any(path.startswith(dep + ".") for dep in new_deps):
                report.additions.append(
                    f"config field {path!r} is now deprecated{_deprecation_text(new_deps.get(path))}"
                )
                _compare_replacement(path, entry, new_deps.get(path), new_fields, report)
            else:
                report.incompatible.append(_removed_field_message(path, entry, version))
            continue
        _compare_field(path, entry, live, report)
    for path in sorted(new_fields.keys() - old_fields.keys()):
        report.additions.append(f"new config field {path!r} ({new_fields[path]['type']})")
    for old_key, dep in new_deps.items():
        if old_key in new_fields:
            report.incompatible.append(f"deprecated key {old_key!r} is still a live field; rename the field first")
        elif dep["new"] is not None and dep["new"] not in new_fields:
            report.incompatible.append(f"deprecated key {old_key!r} points at {dep['new']!r}, which is not a field")
    for old_key, dep in old_deps.items():
        if old_key in new_deps:
            continue
        if _version_tuple(version) >= _version_tuple(dep["remove_in"]):
            report.additions.append(f"deprecated key {old_key!r} removed, as scheduled for {dep['remove_in']}")
        else:
            report.incompatible.append(
                f"deprecated key {old_key!r} was dropped before its removal release {dep['remove_in']} "
                f"(this is {version}); keep its deprecated_field entry until then"
            )


def _deprecation_text(dep: dict[str, Any] | None) -> str:
    if dep is None:
        return " (its section is)"
    use = f"use {dep['new']!r}" if dep["new"] else "no replacement"
    return f": {use}, removed in {dep['remove_in']}"


def _compare_replacement(
    path: str, old: dict[str, Any], dep: dict[str, Any] | None, new_fields: dict[str, Any], report: CompatReport
) -> None:
    """A renamed or moved field is the same field under a new key: the old key keeps loading into it, so its type
    and default must not change (the guard would miss a type change hidden in a rename otherwise)."""
    if dep is None or dep["new"] is None or dep["new"] not in new_fields:
        return
    _compare_field(f"{path} -> {dep['new']}", old, new_fields[dep["new"]], report)


def _compare_field(path: str, old: dict[str, Any], new: dict[str, Any], report: CompatReport) -> None:
    if old.get("section") and new.get("section"):
        return  # a section's class may be renamed: users write its dotted keys, which are compared one by one
    if old["type"] != new["type"]:
        widened = (
            old.get("choices") is not None
            and set(old["choices"]) <= set(new.get("choices") or ())
            and _LITERAL.sub("Literal", old["type"]) == _LITERAL.sub("Literal", new["type"])
        )
        if widened:
            report.additions.append(f"config field {path!r} accepts new choices: {new['type']}")
        else:
            report.incompatible.append(
                f"config field {path!r} changed type {old['type']} -> {new['type']}; never change an existing "
                f"field's type: add a field under a new name and deprecate this one with deprecated_field(...) "
                f"in rlsdk/config/deprecations.py"
            )
    if new.get("required") and not old.get("required"):
        report.incompatible.append(f"config field {path!r} became required; configs that omit it now fail")
    elif "default" in old and "default" in new and old["default"] != new["default"]:
        report.incompatible.append(
            f"config field {path!r} changed default {old['default']!r} -> {new['default']!r}, which silently "
            f"changes every run that relies on it; if that is deliberate, say so in the change note and {_UPDATE}"
        )


def _compare_api(old: dict[str, Any], new: dict[str, Any], report: CompatReport) -> None:
    for name, entry in old.items():
        live = new.get(name)
        if live is None:
            report.incompatible.append(
                f"public name rlsdk.{name} was removed from rlsdk.__all__; keep it importable for a release as an "
                f"alias that warns with DeprecationWarning (naming the replacement), then remove it"
            )
            continue
        if entry["kind"] != live["kind"]:
            report.incompatible.append(f"rlsdk.{name} changed from a {entry['kind']} to a {live['kind']}")
            continue
        _compare_callable(f"rlsdk.{name}", entry, live, report)
        old_members, new_members = entry.get("members", {}), live.get("members", {})
        for member, spec in old_members.items():
            if member not in new_members:
                report.incompatible.append(
                    f"rlsdk.{name}.{member} was removed; keep it for a release, warning with DeprecationWarning"
                )
            else:
                _compare_callable(f"rlsdk.{name}.{member}", spec, new_members[member], report)
        for member in sorted(new_members.keys() - old_members.keys()):
            report.additions.append(f"new public member rlsdk.{name}.{member}")
    for name in sorted(new.keys() - old.keys()):
        report.additions.append(f"new public name rlsdk.{name}")


def _compare_callable(where: str, old: dict[str, Any], new: dict[str, Any], report: CompatReport) -> None:
    if "params" not in old or "params" not in new:
        return
    old_params, new_params = _params(old["params"]), _params(new["params"])
    problems: list[str] = []
    for pname, (index, kind, has_default) in old_params.items():
        if pname not in new_params:
            problems.append(f"parameter {pname!r} removed")
            continue
        new_index, new_kind, new_default = new_params[pname]
        if new_kind != kind or (kind.startswith("POSITIONAL") and new_index != index):
            problems.append(f"parameter {pname!r} moved or changed kind ({kind} -> {new_kind})")
        if has_default and not new_default:
            problems.append(f"parameter {pname!r} lost its default")
    for pname in sorted(new_params.keys() - old_params.keys()):
        _, kind, has_default = new_params[pname]
        if not has_default and kind not in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            problems.append(f"new required parameter {pname!r}")
    if problems:
        report.incompatible.append(
            f"{where}{new.get('signature') or ''}: {'; '.join(problems)}; add new parameters with defaults and "
            f"keep old ones working (deprecate first)"
        )
    elif old.get("signature") != new.get("signature"):
        report.additions.append(f"{where} signature changed compatibly: {new.get('signature')}")


def _params(encoded: list[str]) -> dict[str, tuple[int, str, bool]]:
    """``["lr:KEYWORD_ONLY=", ...]`` -> ``{"lr": (index, "KEYWORD_ONLY", has_default)}``."""
    out = {}
    for index, token in enumerate(encoded):
        name, _, kind = token.partition(":")
        out[name] = (index, kind.rstrip("="), kind.endswith("="))
    return out


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])
