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


def test_rlsdk_run_help_lists_recipe_values_apart_from_library_defaults() -> None:
    result = _rlsdk("run", "recipes/grpo_reverse.py", "--help")

    assert result.returncode == 0
    assert "Recipe values vs library defaults" in result.stdout
    assert "--train.max-steps 2000  (library default: 1000)" in result.stdout
    assert "--rollout.max-new-tokens 5  (library default: 32)" in result.stdout
    assert "--train.lr" not in result.stdout.split("Recipe values vs library defaults")[1].split("╭")[0]  # same value


def test_load_recipe_without_main_or_reward_raises_naming_both(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.py"
    recipe.write_text("def config():\n    return None\n")

    with pytest.raises(AttributeError, match=r"main\(\).*or reward"):
        load_recipe(str(recipe))


@pytest.mark.distributed
def test_rlsdk_run_recipe_with_reward_only_trains_through_session_train(tiny_model_dir: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "reward_only.py"
    recipe.write_text(
        "from rlsdk.config import DataConfig, ModelConfig, ObserveConfig, RolloutConfig, SessionConfig, TrainConfig\n"
        "from rlsdk.rewards import reverse_reward as reward\n\n\n"
        "def config():\n"
        f"    return SessionConfig(model=ModelConfig(path={str(tiny_model_dir)!r}),\n"
        "        train=TrainConfig(max_steps=2, micro_batch_size=8),\n"
        "        rollout=RolloutConfig(group_size=2, max_new_tokens=5),\n"
        "        data=DataConfig(prompts_per_step=2, num_examples=16),\n"
        f"        observe=ObserveConfig(output_dir={str(tmp_path / 'out')!r}, console=False))\n"
    )

    result = _rlsdk("run", str(recipe))

    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["step_2"]
