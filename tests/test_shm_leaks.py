"""The suite's own /dev/shm check (tests/_shm_leaks.py): a run whose tests leave an entry fails, naming the test."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent

CONFTEST = textwrap.dedent(
    f"""
    import sys
    sys.path.insert(0, {str(TESTS_DIR)!r})
    from _shm_leaks import ShmLeakTracker

    def pytest_configure(config):
        config.pluginmanager.register(ShmLeakTracker(), "rlsdk-shm-leaks")
    """
)


def _run_project(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_scenario.py").write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "RLSDK_ALLOW_SHM_LEAKS": ""},
    )


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux /dev/shm")
def test_shm_check_when_a_test_leaves_an_entry_fails_the_run_naming_the_test(tmp_path: Path) -> None:
    path = Path(f"/dev/shm/rlsdk-leak-check-{uuid.uuid4().hex}")
    body = f"""
        from pathlib import Path

        def test_passes_without_shared_memory():
            pass

        def test_leaves_a_file():
            Path({str(path)!r}).write_bytes(b"x")
    """
    try:
        result = _run_project(tmp_path, body)
    finally:
        path.unlink(missing_ok=True)

    assert result.returncode == 1, result.stdout
    assert "2 passed" in result.stdout
    assert f"{path}  (added during test_scenario.py::test_leaves_a_file)" in result.stdout


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux /dev/shm")
def test_shm_check_when_tests_remove_what_they_create_passes(tmp_path: Path) -> None:
    path = Path(f"/dev/shm/rlsdk-leak-check-{uuid.uuid4().hex}")
    body = f"""
        from pathlib import Path

        def test_creates_and_removes_a_file():
            Path({str(path)!r}).write_bytes(b"x")
            Path({str(path)!r}).unlink()
    """

    result = _run_project(tmp_path, body)

    assert result.returncode == 0, result.stdout
    assert "/dev/shm leaks" not in result.stdout
