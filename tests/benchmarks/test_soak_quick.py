"""`benchmarks/soak.py --quick` runs end to end and leaves no process or descriptor behind (a smoke test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "soak.py"

# ~25 s alone on 2 cores (a 2-rank Session for 30 steps); longer on loaded cores.
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.timeout(600)
def test_soak_quick_exits_zero_and_writes_samples_with_no_leak_after_close(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"

    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)], capture_output=True, text=True, timeout=540
    )

    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["quick"] is True and data["steps"] == 30 and data["passed"] is True
    assert [row["step"] for row in data["samples"]] == list(range(31))  # step 0, then every step
    assert {"controller_rss_mib", "rank0_rss_mib", "rank1_rss_mib", "controller_fds", "children"} <= set(
        data["figures"]
    )
    assert data["after_close"]["children"] == 0 and data["after_close"]["surviving_ranks"] == []
    assert data["after_close"]["controller_fds"] <= data["baseline"]["controller_fds"]
    assert "versions" in data["environment"]
