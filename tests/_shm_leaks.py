"""Fail the run when a test leaves entries in /dev/shm, naming the test that added each one.

/dev/shm is shared by every user of the machine and lives in memory until reboot: a semaphore of a killed process
(``sem.mp-*``: multiprocessing's named semaphores, unlinked by their owner or its resource tracker), a vLLM queue
(``psm_*``) or published weights (``rlsdk-*``) that nobody unlinks stay there. Each test's additions are recorded;
the entries still present once the session's fixtures are torn down, and held by no live process, fail the run with
the test that added them. An entry a live process maps or holds open is not (yet) a leak: another test run on the
same machine may own it. Set ``RLSDK_ALLOW_SHM_LEAKS=1`` to skip the check.
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


def _held() -> set[str]:
    """The watched entries some live process maps or holds open (for a directory: a file inside it)."""
    prefix = SHM_DIR + "/"
    held: set[str] = set()

    def add(path: str) -> None:
        name = path[len(prefix) :].split("/", 1)[0].removesuffix(" (deleted)")
        if path.startswith(prefix) and name.startswith(WATCHED):
            held.add(name)

    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    mapped = line.rstrip("\n").partition(" " + prefix)[2]  # the path column, after the inode
                    if mapped:
                        add(prefix + mapped)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return held


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
        present = _entries() & set(self.added_by)
        left = sorted(present - _held()) if present else []
        if not left:
            return
        lines = [f"  {SHM_DIR}/{name}  (added during {self.added_by[name]})" for name in left]
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "the tests left these entries in /dev/shm (a killed process's, never unlinked):\n" + "\n".join(lines)
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_sep("=", "/dev/shm leaks", red=True)
            reporter.write_line(message)
        if session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
