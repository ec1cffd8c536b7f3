"""Library lint: no ``print``, no wildcard imports, no process-group creation at import time.

``python -m rlsdk.testing.lint [PATH ...]`` (default: ``rlsdk``) checks Python files and directories and exits
1 listing each finding as ``path:line:col: CODE message``. Run by pre-commit and ``make lint``.

- RLS001 ``print(...)``: log through the project logger (``rlsdk.observe.logging.get_logger``).
- RLS002 ``from x import *``: import names explicitly.
- RLS003 a call that creates a process group or accelerator state (``init_process_group``, ``new_group``,
  ``new_subgroups``, ``init_device_mesh``, ``Accelerator(``, ``PartialState(``) that runs at import time: in a
  module or class body, a decorator or a default argument, outside ``if __name__ == "__main__":``. Importing
  rlsdk must only define things; a notebook re-imports and re-runs cells.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

GROUP_CALLS = frozenset(
    {"init_process_group", "new_group", "new_subgroups", "init_device_mesh", "Accelerator", "PartialState"}
)


def check_source(source: str, path: str = "<string>") -> list[str]:
    """Findings in one module's source, as ``path:line:col: CODE message`` lines."""
    tree = ast.parse(source, filename=path)
    findings: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            findings.append((node.lineno, node.col_offset, "RLS001 print() in library code: use the project logger"))
        elif isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names):
            findings.append((node.lineno, node.col_offset, f"RLS002 wildcard import from {node.module}"))
    for call in _import_time_calls(tree.body):
        name = _call_name(call)
        if name in GROUP_CALLS:
            message = f"RLS003 {name}() runs at import time: create process groups inside a function"
            findings.append((call.lineno, call.col_offset, message))
    return [f"{path}:{line}:{col + 1}: {message}" for line, col, message in sorted(findings)]


def _import_time_calls(body: Sequence[ast.stmt]) -> Iterator[ast.Call]:
    """Calls that run when the module is imported: function bodies (and lambdas) are skipped."""
    for stmt in body:
        if _is_main_guard(stmt):
            continue
        stack: list[ast.AST] = [stmt]
        while stack:
            node = stack.pop()
            if isinstance(node, ast.Call):
                yield node
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defaults = [d for d in node.args.kw_defaults if d is not None]  # None: no default
                stack.extend([*node.decorator_list, *node.args.defaults, *defaults])
                continue
            if isinstance(node, ast.Lambda):
                continue
            stack.extend(ast.iter_child_nodes(node))


def _is_main_guard(stmt: ast.stmt) -> bool:
    test = stmt.test if isinstance(stmt, ast.If) else None
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def _call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _python_files(paths: Sequence[str]) -> Iterator[Path]:
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)
        elif path.suffix == ".py":
            yield path


def main(argv: Sequence[str] | None = None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv) or ["rlsdk"]
    findings = [line for file in _python_files(paths) for line in check_source(file.read_text(), str(file))]
    if findings:
        sys.stdout.write("\n".join(findings) + "\n")
    return 1 if findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
