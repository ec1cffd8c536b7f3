"""Fail the run when a test leaves entries in /dev/shm, naming the test that added each one.

/dev/shm is shared by every user of the machine and lives in memory until reboot: a semaphore of a killed process
(``sem.mp-*``: multiprocessing's named semaphores, unlinked by their owner or its resource tracker), a vLLM queue
(``psm_*``) or published weights (``rlsdk-*``) that nobody unlinks stay there. Each test's additions are recorded;
the entries still present once the session's fixtures are torn down fail the run with the test that added them.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest

SHM_DIR = "/dev/shm"
# Prefixes of what this project, multiprocessing and vLLM create; other users' entries are not ours to judge.
WATCHED = ("sem.mp-", "psm_", "rlsdk-")


def _entries() -> set[str]:
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(WATCHED)}
    except OSError:
        return set()


class ShmLeakTracker:
    def __init__(self) -> None:
        self.added_by: dict[str, str] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        before = _entries()
        yield
        for name in _entries() - before:
            self.added_by.setdefault(name, item.nodeid)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        gc.collect()  # runs multiprocessing's finalizers for queues and locks nobody holds any more
        left = sorted(name for name in self.added_by if name in _entries())
        if not left:
            return
        lines = [f"  {SHM_DIR}/{name}  (added during {self.added_by[name]})" for name in left]
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "the tests left these entries in /dev/shm (a killed process's, never unlinked):\n" + "\n".join(lines)
        if reporter is not None:
            reporter.write_sep("=", "/dev/shm leaks", red=True)
            reporter.write_line(message)
        if session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
