"""`rlsdk promote`: tagged notebook cells become config() and async main(config); bad notebooks fail clearly."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlsdk.cli import load_recipe
from rlsdk.notebook.promote import PromoteError, promote_notebook, write_recipe

ROOT = Path(__file__).resolve().parents[2]


def _notebook(tmp_path: Path, cells: list[tuple[str, str | None]], name: str = "nb.ipynb") -> Path:
    """A notebook of code cells ``(source, tag)``, after a markdown title cell."""
    nb_cells = [{"cell_type": "markdown", "metadata": {}, "source": ["# Toy run\n", "\n", "What it does."]}]
    for source, tag in cells:
        nb_cells.append(
            {
                "cell_type": "code",
                "metadata": {"tags": [tag]} if tag else {},
                "source": source,
                "outputs": [],
                "execution_count": None,
            }
        )
    path = tmp_path / name
    path.write_text(json.dumps({"cells": nb_cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


TOY = [
    ("import asyncio\nfrom rlsdk.config import ModelConfig, SessionConfig", "recipe"),
    ("config = SessionConfig(model=ModelConfig(path='m'), seed=3)\nconfig", "recipe:config"),
    ("print('notebook only')", None),
    ("await asyncio.sleep(0)\nvalues = [config.seed]\nvalues", "recipe:main"),
    ("%timeit 1", None),
    ("values.append(await asyncio.sleep(0, result=7))\n{'values': values,\n 'seed': config.seed}", "recipe:main"),
]


def test_promote_builds_config_and_main_returning_the_last_expression(tmp_path: Path) -> None:
    source = promote_notebook(_notebook(tmp_path, TOY))
    recipe_path = tmp_path / "toy.py"
    recipe_path.write_text(source)

    recipe = load_recipe(str(recipe_path))
    config = recipe.config()
    result = asyncio.run(recipe.main(config))

    assert config.seed == 3
    assert result == {"values": [3, 7], "seed": 3}
    assert "notebook only" not in source and "timeit" not in source
    assert source.startswith('"""Toy run\n\nWhat it does.')
    assert "\n    values\n" not in source  # the first main cell's display-only expression is dropped


def test_promote_rejects_magics_in_tagged_cells_naming_the_cell(tmp_path: Path) -> None:
    path = _notebook(tmp_path, [*TOY[:2], ("!pip install x\nawait f()", "recipe:main")])

    with pytest.raises(PromoteError, match=r"cell 3 .*shell escapes.*pip install"):
        promote_notebook(path)


def test_promote_without_config_cell_or_config_variable_raises(tmp_path: Path) -> None:
    with pytest.raises(PromoteError, match="exactly one cell tagged 'recipe:config'"):
        promote_notebook(_notebook(tmp_path, [TOY[0], TOY[3]]))
    with pytest.raises(PromoteError, match="must assign the variable `config`"):
        promote_notebook(_notebook(tmp_path, [TOY[0], ("cfg = 1", "recipe:config"), TOY[3]]))


def test_promote_rejects_top_level_await_in_a_module_cell(tmp_path: Path) -> None:
    path = _notebook(tmp_path, [("import asyncio\nawait asyncio.sleep(0)", "recipe"), TOY[1], TOY[3]])

    with pytest.raises(PromoteError, match="tag it 'recipe:main' instead"):
        promote_notebook(path)


def test_write_recipe_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    notebook = _notebook(tmp_path, TOY)
    out = tmp_path / "recipes" / "toy.py"
    write_recipe(notebook, out)

    with pytest.raises(PromoteError, match="--force"):
        write_recipe(notebook, out)
    assert write_recipe(notebook, out, force=True) == out


def test_rlsdk_promote_cli_writes_recipe_and_exits_2_on_a_bad_notebook(tmp_path: Path) -> None:
    notebook = _notebook(tmp_path, TOY)
    bad = _notebook(tmp_path, [TOY[0]], name="bad.ipynb")
    out = tmp_path / "toy_recipe.py"

    ok = subprocess.run(
        [sys.executable, "-m", "rlsdk.cli", "promote", str(notebook), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    failed = subprocess.run(
        [sys.executable, "-m", "rlsdk.cli", "promote", str(bad), "-o", str(tmp_path / "bad.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )

    assert ok.returncode == 0, ok.stderr
    assert "async def main(config: SessionConfig)" in out.read_text()
    assert failed.returncode == 2
    assert "recipe:config" in failed.stderr and "Traceback" not in failed.stderr


@pytest.mark.parametrize("name", ["quickstart.ipynb", "custom_reward_and_workflow.ipynb"])
def test_shipped_notebooks_promote_to_compiling_recipes(name: str) -> None:
    source = promote_notebook(ROOT / "notebooks" / name)

    assert "def config() -> SessionConfig:" in source and "await session.close()" in source
