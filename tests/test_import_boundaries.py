"""The package's import boundaries (issue 20), checked over the source with ``ast``: no import runs.

Every import counts, at module level, inside a function (a lazy import is still a dependency) or under
``TYPE_CHECKING``. Rules:

- ``engine.train`` and ``engine.inference`` do not import each other (what both need lives in ``rlsdk.generation``);
- ``engine`` and ``launch`` do not import each other (process helpers both need live in ``rlsdk.procutil``);
- ``algorithms`` imports torch and the standard library only (pure tensor functions);
- ``config`` imports no other rlsdk module (it is read before anything else is built);
- ``worker`` and ``debug`` do not import ``session`` (they run in rank processes, the Session in the controller);
- no import cycle between rlsdk modules;
- no module imports another module's private (``_name``) names, nor reads one as ``module._name``.

What cannot hold yet is listed in ``ALLOWED`` with its reason; an entry that no longer matches a violation fails too,
so the list only shrinks.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

RLSDK = Path(__file__).resolve().parents[1] / "rlsdk"


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name of the importing file
    imported: str  # dotted name of the imported module (the longest prefix that is a module of the tree)
    line: int
    private_name: str | None = None  # set when the import (or attribute read) names another module's `_name`


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root`` (a package named ``root.name``)."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The longest prefix of ``name`` that is a module of the tree, else ``name`` (a third-party module)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return name


def collect_imports(root: Path) -> list[Import]:
    """Every import of every module under ``root`` (third-party ones too), with private names marked."""
    modules = module_names(root)
    found: list[Import] = []
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        module_aliases: dict[str, str] = {}  # local name bound to a module of the tree -> that module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _resolve(alias.name, modules)
                    found.append(Import(module, target, node.lineno))
                    if alias.asname is not None and target == alias.name:
                        module_aliases[alias.asname] = target
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    if submodule in modules:
                        found.append(Import(module, submodule, node.lineno))
                        module_aliases[alias.asname or alias.name] = submodule
                        continue
                    target = _resolve(base, modules)
                    private = alias.name if _is_private(alias.name) and target != module else None
                    found.append(Import(module, target, node.lineno, private))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases
                and _is_private(node.attr)
                and module_aliases[node.value.id] != module
            ):
                found.append(Import(module, module_aliases[node.value.id], node.lineno, node.attr))
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _third_party_or_stdlib_allowed_in_algorithms(imported: str) -> bool:
    top = imported.split(".")[0]
    return top in ("torch", "__future__") or top in sys.stdlib_module_names


def _layer_rule(importer: str, imported: str, pkg: str) -> str | None:
    """The layering rule ``importer -> imported`` breaks (``pkg``: the top package's name), else None."""
    own = imported == pkg or imported.startswith(pkg + ".")
    pairs = (
        (f"{pkg}.engine.train", f"{pkg}.engine.inference", "engine.train -> engine.inference"),
        (f"{pkg}.engine.inference", f"{pkg}.engine.train", "engine.inference -> engine.train"),
        (f"{pkg}.engine", f"{pkg}.launch", "engine -> launch"),
        (f"{pkg}.launch", f"{pkg}.engine", "launch -> engine"),
        (f"{pkg}.worker", f"{pkg}.session", "worker -> session"),
        (f"{pkg}.debug", f"{pkg}.session", "debug -> session"),
    )
    for source, target, rule in pairs:
        if _within(importer, source) and _within(imported, target):
            return rule
    if _within(importer, f"{pkg}.config") and own and not _within(imported, f"{pkg}.config"):
        return "config -> other rlsdk module"
    if _within(importer, f"{pkg}.algorithms"):
        if own and not _within(imported, f"{pkg}.algorithms"):
            return "algorithms -> other rlsdk module"
        if not own and not _third_party_or_stdlib_allowed_in_algorithms(imported):
            return "algorithms -> third party other than torch"
    return None


def _cycles(edges: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[tuple[str, ...]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(edges.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(edges.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(tuple(sorted(component)))
    return components


def violations(root: Path) -> dict[tuple[str, ...], str]:
    """Every broken rule under package ``root``: key ``(rule, importer, imported[, name])`` or ``("cycle", *members)``
    -> where (file:line)."""
    pkg = root.name
    modules = module_names(root)
    found: dict[tuple[str, ...], str] = {}
    edges: dict[str, set[str]] = {}
    for imp in collect_imports(root):
        where = f"{modules[imp.importer].relative_to(root.parent)}:{imp.line}"
        rule = _layer_rule(imp.importer, imp.imported, pkg)
        if rule is not None:
            found.setdefault((rule, imp.importer, imp.imported), where)
        if imp.private_name is not None and imp.imported in modules:
            found.setdefault(("private name", imp.importer, imp.imported, imp.private_name), where)
        if imp.imported in modules and imp.imported != imp.importer:
            edges.setdefault(imp.importer, set()).add(imp.imported)
    for component in _cycles(edges):
        found[("cycle", *component)] = " <-> ".join(component)
    return found


# Violations that cannot go yet, each with its reason. Remove an entry when its violation goes (a stale entry fails).
ALLOWED: dict[tuple[str, ...], str] = {}


def test_rlsdk_imports_when_checked_break_no_boundary_beyond_the_listed_exceptions() -> None:
    found = violations(RLSDK)

    unexpected = {key: where for key, where in found.items() if key not in ALLOWED}

    assert not unexpected, "import boundaries broken (fix them, or list one in ALLOWED with its reason):\n" + (
        "\n".join(f"  {' | '.join(key)}  at {where}" for key, where in sorted(unexpected.items()))
    )


def test_allowed_exceptions_when_checked_each_still_matches_a_violation() -> None:
    found = violations(RLSDK)

    stale = [key for key in ALLOWED if key not in found]

    assert not stale, f"these ALLOWED entries no longer match a violation; remove them: {stale}"


# A synthetic package breaking each rule once: the checker must flag every one, so the real check cannot pass
# vacuously (a path typo, a parser that sees no imports).
SYNTHETIC: dict[str, str] = {
    "engine/__init__.py": "",
    "engine/train/__init__.py": "",
    "engine/train/loop.py": "from pkg.engine.inference import sampler\n",
    "engine/inference/__init__.py": "",
    "engine/inference/sampler.py": "def f():\n    import pkg.engine.train.loop\n",
    "engine/inference/server.py": "from pkg.launch.ports import free\n",
    "launch/__init__.py": "",
    "launch/ports.py": "free = 0\nfrom ..engine.inference import server\n",
    "algorithms/__init__.py": "",
    "algorithms/loss.py": "import torch\nimport numpy\nfrom pkg.observe import log\n",
    "config/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.session import Session\n",
    "worker/__init__.py": "from pkg.session import Session\n",
    "debug/__init__.py": "from pkg import session\n",
    "session.py": "Session = object\n",
    "observe/__init__.py": "",
    "observe/log.py": "from pkg.observe.metrics import _secret\n",
    "observe/metrics.py": "import pkg.observe.log as log\n_secret = 1\nlog._helper\n",
}

SYNTHETIC_EXPECTED: list[tuple[str, ...]] = [
    ("engine.train -> engine.inference", "pkg.engine.train.loop", "pkg.engine.inference.sampler"),
    ("engine.inference -> engine.train", "pkg.engine.inference.sampler", "pkg.engine.train.loop"),
    ("engine -> launch", "pkg.engine.inference.server", "pkg.launch.ports"),
    ("launch -> engine", "pkg.launch.ports", "pkg.engine.inference.server"),
    ("algorithms -> third party other than torch", "pkg.algorithms.loss", "numpy"),
    ("algorithms -> other rlsdk module", "pkg.algorithms.loss", "pkg.observe.log"),
    ("config -> other rlsdk module", "pkg.config", "pkg.session"),
    ("worker -> session", "pkg.worker", "pkg.session"),
    ("debug -> session", "pkg.debug", "pkg.session"),
    ("private name", "pkg.observe.log", "pkg.observe.metrics", "_secret"),
    ("private name", "pkg.observe.metrics", "pkg.observe.log", "_helper"),
    ("cycle", "pkg.engine.inference.sampler", "pkg.engine.train.loop"),
    ("cycle", "pkg.engine.inference.server", "pkg.launch.ports"),
    ("cycle", "pkg.observe.log", "pkg.observe.metrics"),
]


@pytest.fixture
def synthetic_package(tmp_path: Path) -> Path:
    root = tmp_path / "pkg"
    for relative, text in {"__init__.py": "", **SYNTHETIC}.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize("expected", SYNTHETIC_EXPECTED, ids=lambda key: " | ".join(key))
def test_checker_when_a_package_breaks_a_rule_flags_it(synthetic_package: Path, expected: tuple[str, ...]) -> None:
    found = violations(synthetic_package)

    assert expected in found, f"{expected} not flagged; found {sorted(found)}"


def test_checker_when_a_package_breaks_no_rule_flags_nothing(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    (root / "engine" / "train").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "engine" / "__init__.py").write_text("")
    (root / "engine" / "train" / "__init__.py").write_text("from pkg.generation import sample\n")
    (root / "generation.py").write_text(
        "import torch\n\n\ndef sample():\n    return _private()\n\n\ndef _private():\n    pass\n"
    )

    assert violations(root) == {}
