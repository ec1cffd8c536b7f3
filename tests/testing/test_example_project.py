"""tests/example_project/ is a user's project: its own conftest enables the plugin, as a user would."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlsdk.testing.plugin import REPORT_TITLE

EXAMPLE = Path(__file__).parents[1] / "example_project"


def _vllm_installed() -> bool:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin not in (None, "namespace")  # not tests/engine/vllm/


@pytest.mark.distributed  # the example starts 2 real gloo ranks
def test_example_project_run_ends_with_skipped_suites_report(tmp_path: Path) -> None:
    project = tmp_path / "project"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))

    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=240,
    )

    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    report = out[out.index(REPORT_TITLE) :]
    assert "- gpu: requires a CUDA device: torch.cuda.is_available() is False (1): test_distributed.py (1)" in report
    if _vllm_installed():  # `make test` installs the vllm extra: the example's vllm test then runs
        assert "5 passed, 1 skipped" in out
        assert "Skipped: 1 test(s):" in report
        assert "Markers with no test run: slow, notebook, gpu, multinode, security." in report
    else:
        assert "4 passed, 2 skipped" in out
        assert "Skipped: 2 test(s):" in report
        assert "- vllm: the vllm extra is not installed (1): test_distributed.py (1)" in report
        assert "Markers with no test run: slow, notebook, vllm, gpu, multinode, security." in report
