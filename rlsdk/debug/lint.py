"""Lint aid: find ``torch.distributed`` collectives inside rank-conditional branches (a classic hang).

Flags a call to a collective (``all_reduce``, ``broadcast``, ``barrier``, ``all_gather``, ``send``, ...,
whether written ``dist.all_reduce``, ``torch.distributed.all_reduce`` or a bare imported name) that sits in the
body or ``else`` of an ``if`` whose test mentions the rank: ``rank``, ``local_rank``, ``get_rank()``,
``is_main_process``, ``is_local_main_process``, ``process_index``. A collective must be called by every rank of
its group; one inside such a branch usually is not. Deliberate cases (point-to-point pairs, a subgroup that
only those ranks form) can carry ``# rlsdk: allow-conditional-collective`` on the call's line.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "COLLECTIVES",
    "Finding",
    "assert_no_rank_conditional_collectives",
    "lint_file",
    "lint_source",
    "site_is_rank_conditional",
]

COLLECTIVES = frozenset(
    {
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
        "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
        "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "recv",
        "isend", "irecv", "monitored_barrier", "batch_isend_irecv",
    }
)  # fmt: skip
"""Function names treated as collectives."""

_RANK_NAMES = frozenset(
    {"rank", "local_rank", "global_rank", "get_rank", "is_main_process", "is_local_main_process", "process_index"}
)
_ALLOW = "rlsdk: allow-conditional-collective"


@dataclass(frozen=True)
class Finding:
    """One collective call inside a rank-conditional branch."""

    path: str
    line: int
    call: str
    condition: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.call}() inside `if {self.condition}`: every rank must call it"


def _mentions_rank(test: ast.AST) -> bool:
    for node in ast.walk(test):
        if isinstance(node, ast.Name) and node.id in _RANK_NAMES:
            return True
        if isinstance(node, ast.Attribute) and node.attr in _RANK_NAMES:
            return True
    return False


def _call_name(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def lint_source(source: str, path: str = "<source>") -> list[Finding]:
    """Findings in Python ``source`` (sorted by line). Raises ``SyntaxError`` for unparsable source."""
    tree = ast.parse(source, filename=path)
    lines = source.splitlines()
    findings: list[Finding] = []

    def visit(node: ast.AST, condition: str | None) -> None:
        if isinstance(node, ast.If) and _mentions_rank(node.test):
            text = ast.unparse(node.test)
            visit(node.test, condition)
            for child in [*node.body, *node.orelse]:
                visit(child, text)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            condition = None  # a function defined in a branch runs where it is called
        if isinstance(node, ast.Call) and condition is not None:
            name = _call_name(node)
            if name in COLLECTIVES and _ALLOW not in lines[node.lineno - 1]:
                findings.append(Finding(path, node.lineno, name, condition))
        for child in ast.iter_child_nodes(node):
            visit(child, condition)

    visit(tree, None)
    return sorted(findings, key=lambda finding: finding.line)


def lint_file(path: str | Path) -> list[Finding]:
    """Findings in one file. Raises ``OSError`` / ``SyntaxError``."""
    return lint_source(Path(path).read_text(), str(path))


@functools.lru_cache(maxsize=256)
def _conditional_lines(path: str) -> frozenset[int]:
    try:
        return frozenset(finding.line for finding in lint_file(path))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return frozenset()


def site_is_rank_conditional(site: str) -> bool:
    """Whether the call at ``"file:line"`` is a collective inside a rank-conditional branch (``False`` when the
    file cannot be read). The tracer's analyser uses it to tell an extra collective from an op mismatch."""
    path, _, line = site.rpartition(":")
    return line.isdigit() and int(line) in _conditional_lines(path)


def assert_no_rank_conditional_collectives(*paths: str | Path) -> None:
    """Pytest helper: fail listing every finding in the given files or directories (``*.py`` recursively).

    Raises:
        AssertionError: one line per finding.
    """
    files: list[Path] = []
    for path in map(Path, paths):
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    findings = [finding for file in files for finding in lint_file(file)]
    if findings:
        raise AssertionError(
            "collectives inside rank-conditional branches:\n" + "\n".join(f"  {finding}" for finding in findings)
        )
