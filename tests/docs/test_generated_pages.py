"""The generated docs pages (docs/hooks.py) describe the live code; `make docs` builds them with --strict."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from rlsdk.compat.surface import config_fields
from rlsdk.config import SessionConfig
from rlsdk.config import deprecations as deps

HOOKS = Path(__file__).parents[2] / "docs" / "hooks.py"


@pytest.fixture(scope="module")
def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rlsdk_docs_hooks", HOOKS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_lists_every_field_with_its_flag_and_doc(hooks: ModuleType) -> None:
    page = hooks.config_reference()

    for info in config_fields(SessionConfig):
        if not info.section:
            assert f"| `{info.path}` | `--{info.path.replace('_', '-')}` |" in page
    assert "Learning rate, > 0." in page


def test_config_reference_registered_deprecation_is_listed(hooks: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deps, "_REGISTRY", {})
    deps.deprecated_field(old="train.learning_rate", new="train.lr", remove_in="0.3")

    page = hooks.config_reference()

    assert "| `train.learning_rate` | `train.lr` | 0.3 |" in page


def test_benchmarks_page_with_results_file_shows_ratios(hooks: ModuleType, tmp_path: Path) -> None:
    stats = {"median": 2.0, "min": 1.0, "max": 3.0, "n": 2}
    results = {
        "environment": {"python": "3.11", "cpu": "cpu", "cpu_count": 2, "versions": {"torch": "2"}},
        "quick": False,
        "step_ms": {"bare": stats, "session": stats, "ratio": 1.25},
        "noop": {"2": {"raw_pyzmq_us": stats, "session_noop_us": stats, "ratio": 2.5}},
    }
    path = tmp_path / "session_overhead.json"
    path.write_text(json.dumps(results))

    page = hooks.benchmarks_page(path)

    assert "| step time (ms) | Session, 2 ranks | 2.0 | 1.0 | 3.0 | 1.25x |" in page
    assert "| no-op round trip (us) | Session, 2 ranks | 2.0 | 1.0 | 3.0 | 2.50x |" in page


def test_benchmarks_page_without_results_file_says_how_to_make_one(hooks: ModuleType, tmp_path: Path) -> None:
    page = hooks.benchmarks_page(tmp_path / "missing.json")

    assert "No results yet" in page
    assert "--json benchmarks/results/session_overhead.json" in page
