"""`rlsdk run`: recipes load, flags come from the config dataclasses, bad input exits cleanly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlsdk.cli import load_recipe

ROOT = Path(__file__).resolve().parents[2]


def _rlsdk(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlsdk.cli", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_load_recipe_default_recipe_exposes_config_and_main() -> None:
    recipe = load_recipe(str(ROOT / "recipes" / "grpo_reverse.py"))

    assert recipe.config().rollout.max_new_tokens == 5


def test_load_recipe_missing_file_raises_naming_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.py"):
        load_recipe(str(tmp_path / "nope.py"))


def test_rlsdk_run_bad_flag_value_exits_2_naming_field() -> None:
    result = _rlsdk("run", "recipes/grpo_reverse.py", "--train.lr", "-1")

    assert result.returncode == 2
    assert "lr" in result.stderr


def test_rlsdk_run_missing_config_file_exits_2_without_traceback(tmp_path: Path) -> None:
    result = _rlsdk("run", "recipes/grpo_reverse.py", "--config", str(tmp_path / "missing.yaml"))

    assert result.returncode == 2
    assert "missing.yaml" in result.stderr
    assert "Traceback" not in result.stderr
