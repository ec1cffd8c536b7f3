"""`benchmarks/trl_compare.py --quick` runs end to end (a smoke test: no speed thresholds are asserted)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "trl_compare.py"

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("trl") is None,
        reason='trl is not installed (the bench extra: pip install -e ".[bench]")',
    ),
    # ~55 s alone on 2 cores (4 subprocesses, two of them 2-rank Sessions); longer on loaded cores.
    pytest.mark.slow,
    pytest.mark.distributed,
]


@pytest.mark.timeout(600)
def test_trl_compare_quick_writes_one_run_per_system_with_environment(tmp_path: Path) -> None:
    out = tmp_path / "trl_compare.json"

    subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], check=True, timeout=540)

    data = json.loads(out.read_text())
    assert data["quick"] is True
    assert [run["system"] for run in data["runs"]] == ["trl", "bare", "rlsdk", "rlsdk_async"]
    for run in data["runs"]:
        assert run["steps_run"] == 5
        assert len(run["step_time_s"]) == len(run["reward_mean"]) == 5
        assert run["step_s_median"] > 0
        assert all(0.0 <= r <= 1.0 for r in run["reward_mean"])
    assert set(data["summary"]) == {"trl", "bare", "rlsdk", "rlsdk_async"}
    assert data["ratios"]["rlsdk_over_bare_step"] > 0
    assert data["environment"]["versions"]["trl"]
    assert data["trl_settings"]["loss_type"] == "dapo"
    assert data["trl_deviations"]
