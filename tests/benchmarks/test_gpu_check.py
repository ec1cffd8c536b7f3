"""benchmarks/gpu_check.py: on a machine without CUDA it exits at once saying so and writes nothing; a part that
fails or does not fit the time budget is recorded, and the other parts still run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_check.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the early exit without CUDA; this machine has CUDA")
def test_gpu_check_without_cuda_exits_with_status_2_saying_so_and_writes_no_json(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"

    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out)], capture_output=True, text=True, timeout=120
    )

    assert proc.returncode == 2
    assert "no CUDA device present: torch.cuda.is_available() is False" in proc.stderr
    assert not out.exists()


def test_gpu_check_part_records_its_error_and_a_part_past_the_budget_is_skipped() -> None:
    gpu_check = _module()
    results: dict[str, object] = {}

    def broken() -> dict[str, object]:
        raise RuntimeError("NCCL error: unhandled cuda error")

    deadline = time.monotonic() + 60
    gpu_check.run_part(results, "broken", deadline, 1, broken)
    gpu_check.run_part(results, "fits", deadline, 1, lambda: {"value": 3})
    gpu_check.run_part(results, "too_long", deadline, 3600, lambda: {"value": 4})

    assert results["broken"]["error"] == "RuntimeError: NCCL error: unhandled cuda error"  # type: ignore[index]
    assert results["fits"]["value"] == 3  # type: ignore[index]
    assert "skipped" in results["too_long"] and "value" not in results["too_long"]  # type: ignore[operator]
