"""The notebooks in notebooks/ are committed with outputs cleared (tests/notebooks/test_notebooks.py runs them)."""

from __future__ import annotations

import json
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def test_shipped_notebooks_are_committed_with_outputs_cleared() -> None:
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = [c for c in cells if c["cell_type"] == "code"]
        assert all(not c["outputs"] and c["execution_count"] is None for c in code), path.name
