"""Promote a notebook to a recipe: ``rlsdk promote NOTEBOOK.ipynb -o recipes/NAME.py``.

Cells are chosen by their tags (cell metadata ``tags``; in JupyterLab: the property inspector, "Common Tools"):

- ``recipe``: module-level code, copied as is, in order (imports, constants, reward functions, workflow classes);
- ``recipe:config``: exactly one cell that assigns ``config`` (a ``SessionConfig``); it becomes the body of
  ``def config()``, which returns it;
- ``recipe:main``: the step cells, in order; they become the body of ``async def main(config)``. Top-level
  ``await`` needs no change inside an ``async def``. A cell's trailing display-only expression (a bare name,
  attribute, subscript or tuple of those, as in ``rollout`` or ``session.versions``) is dropped, except in the last
  ``recipe:main`` cell, where the trailing expression becomes ``main``'s return value.

Untagged cells (inspection, the dashboard, plots) are left out. Tagged cells may not use IPython magics or shell
escapes (``%``, ``!``), and module-level (``recipe``) cells may not use names that only ``main`` defines. The
notebook's first markdown cell becomes the recipe's docstring. The same config objects and the same calls run in
both, so under the same seed the recipe reproduces the notebook's metrics and version sequence (see
``tests/notebooks/test_promote_equivalence.py``).
"""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path
from typing import Any

TAG_MODULE = "recipe"
TAG_CONFIG = "recipe:config"
TAG_MAIN = "recipe:main"
TAGS = (TAG_MODULE, TAG_CONFIG, TAG_MAIN)
_DISPLAY_ONLY = (ast.Name, ast.Attribute, ast.Subscript, ast.Constant)


class PromoteError(ValueError):
    """The notebook cannot be promoted; the message names the cell (by its index) and what to change."""


def _source(cell: dict[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def _tags(cell: dict[str, Any]) -> list[str]:
    return [t for t in cell.get("metadata", {}).get("tags", []) if t in TAGS]


def _parse(code: str, where: str) -> ast.Module:
    for number, line in enumerate(code.splitlines(), 1):
        if line.lstrip().startswith(("%", "!")):
            raise PromoteError(
                f"{where}, line {number}: IPython magics and shell escapes cannot go in a recipe: {line!r}"
            )
    try:
        # Top-level await is valid in a notebook cell (and in the body of main).
        return compile(code, where, "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        raise PromoteError(f"{where} is not valid Python: {exc}") from exc


def _is_display_only(node: ast.stmt) -> bool:
    if not isinstance(node, ast.Expr):
        return False
    value = node.value
    if isinstance(value, ast.Tuple):
        return all(isinstance(elt, _DISPLAY_ONLY) for elt in value.elts)
    return isinstance(value, _DISPLAY_ONLY)


def _main_cell_body(code: str, where: str, *, last: bool) -> str:
    """The cell's code for ``main``: trailing display dropped, or turned into ``return`` in the last cell."""
    code = code.rstrip()
    tree = _parse(code, where)
    if not tree.body:
        return ""
    tail = tree.body[-1]
    if not isinstance(tail, ast.Expr) or not (last or _is_display_only(tail)):
        return code
    lines = code.splitlines()
    head = "\n".join(lines[: tail.lineno - 1]).rstrip()
    if not last:
        return head
    expr = "\n".join(lines[tail.lineno - 1 : tail.end_lineno]).strip()
    returned = f"return {expr}" if "\n" not in expr else f"return (\n{expr}\n)"
    return f"{head}\n{returned}".strip("\n")


def _docstring(notebook: dict[str, Any], path: Path) -> str:
    text = ""
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "markdown":
            text = _source(cell).strip()
            break
    lines = [line.removeprefix("# ").rstrip() for line in text.splitlines()]
    body = "\n".join(lines).replace('"""', "'''").replace("\\", "\\\\")
    note = (
        f"Promoted from {path.as_posix()} by `rlsdk promote`\n"
        "(cells tagged recipe, recipe:config, recipe:main). Edit the notebook and promote it again\n"
        "rather than editing this file by hand."
    )
    return f'"""{body}\n\n{note}\n"""' if body else f'"""{note}\n"""'


def promote_notebook(notebook_path: str | Path) -> str:
    """The recipe source for the notebook at ``notebook_path`` (see the module docstring for the convention).

    Raises ``PromoteError`` naming the cell when the tags are missing or inconsistent, a tagged cell uses a magic,
    the config cell does not assign ``config``, or the result does not compile; ``FileNotFoundError`` when the
    notebook does not exist.
    """
    path = Path(notebook_path)
    if not path.is_file():
        raise FileNotFoundError(f"notebook {str(path)!r} does not exist")
    try:
        notebook = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PromoteError(f"{path} is not a notebook (invalid JSON: {exc})") from exc
    module_parts: list[str] = []
    config_parts: list[str] = []
    main_cells: list[tuple[int, str]] = []
    for index, cell in enumerate(notebook.get("cells", [])):
        tags = _tags(cell)
        if cell.get("cell_type") != "code" or not tags:
            continue
        if len(tags) > 1:
            raise PromoteError(f"cell {index} has several recipe tags {tags}; give it exactly one of {list(TAGS)}")
        code = _source(cell).rstrip()
        where = f"cell {index} (tagged {tags[0]!r})"
        tree = _parse(code, where)
        if tags[0] == TAG_MODULE:
            try:
                compile(tree, where, "exec")  # rejects top-level await (and async for/with)
            except SyntaxError as exc:
                raise PromoteError(
                    f"{where} cannot run at module level ({exc.msg}): tag it {TAG_MAIN!r} instead"
                ) from exc
            module_parts.append(code)
        elif tags[0] == TAG_CONFIG:
            assigned = {
                target.id
                for node in ast.walk(tree)
                if isinstance(node, ast.Assign | ast.AnnAssign)
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(target, ast.Name)
            }
            if "config" not in assigned:
                raise PromoteError(f"{where} must assign the variable `config` (the SessionConfig of the run)")
            config_parts.append(_main_cell_body(code, where, last=False))
        else:
            main_cells.append((index, code))
    if len(config_parts) != 1:
        raise PromoteError(f"{path} needs exactly one cell tagged {TAG_CONFIG!r}; found {len(config_parts)}")
    if not main_cells:
        raise PromoteError(f"{path} has no cell tagged {TAG_MAIN!r}: tag the cells that start and step the Session")
    main_parts = [
        _main_cell_body(code, f"cell {index} (tagged {TAG_MAIN!r})", last=i == len(main_cells) - 1)
        for i, (index, code) in enumerate(main_cells)
    ]
    module_code = "\n\n\n".join(module_parts)
    imports = ["from __future__ import annotations", ""]
    if not _binds(module_code, "Any"):
        imports.append("from typing import Any")
    if not _binds(module_code, "SessionConfig"):
        imports.append("from rlsdk.config import SessionConfig")
    parts = [
        _docstring(notebook, path),
        "",
        "\n".join(imports).strip(),
        "",
        module_code,
        "",
        "",
        "def config() -> SessionConfig:",
        textwrap.indent(config_parts[0], "    "),
        "    return config",
        "",
        "",
        "async def main(config: SessionConfig) -> Any:",
        textwrap.indent("\n\n".join(p for p in main_parts if p), "    "),
        "",
    ]
    source = "\n".join(parts)
    source = "\n".join(line.rstrip() for line in source.splitlines()).rstrip() + "\n"
    try:
        compile(source, str(path.with_suffix(".py")), "exec")
    except SyntaxError as exc:
        raise PromoteError(f"the promoted recipe does not compile: {exc}") from exc
    return source


def _binds(code: str, name: str) -> bool:
    """Whether module-level ``code`` imports or defines ``name``."""
    if not code.strip():
        return False
    for node in ast.parse(code).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            if any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
                return True
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return True
    return False


def write_recipe(notebook_path: str | Path, output: str | Path, *, force: bool = False) -> Path:
    """Promote ``notebook_path`` and write the recipe to ``output``; refuses to overwrite unless ``force``."""
    out = Path(output)
    if out.suffix != ".py":
        raise PromoteError(f"the recipe must be a .py file, got {str(out)!r}")
    if out.exists() and not force:
        raise PromoteError(f"{out} exists; pass --force to overwrite it")
    source = promote_notebook(notebook_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(source, encoding="utf-8")
    tmp.replace(out)
    return out
