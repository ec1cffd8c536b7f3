"""environment.yml stays consistent with pyproject.toml."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_environment_yml_lists_exactly_the_pyproject_dependencies() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(item["pip"] for item in env["dependencies"] if isinstance(item, dict))

    listed = {dep for dep in pip_section if not dep.startswith("-e")}

    assert listed == set(project["dependencies"])


def test_torch_is_pinned_to_the_cpu_build_version() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    assert "torch==2.13.0" in project["dependencies"]
