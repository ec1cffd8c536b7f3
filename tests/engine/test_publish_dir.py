"""PublishDir: the weights directory a Session owns, and the sweep that removes those of killed sessions."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from rlsdk.engine.publish_dir import LOCK_NAME, PREFIX, PublishDir, sweep_stale

_HOLD = """
import sys, time
from rlsdk.engine.publish_dir import PublishDir
d = PublishDir(sys.argv[1])
open(d.path + "/v1.safetensors", "wb").write(b"x" * 1000)
print(d.path, flush=True)
time.sleep(600)
"""


def _start_holder(root: Path) -> tuple[subprocess.Popen[str], Path]:
    process = subprocess.Popen([sys.executable, "-c", _HOLD, str(root)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, Path(process.stdout.readline().strip())


def test_new_publish_dir_after_its_owner_was_killed_removes_the_dead_owners_directory(tmp_path: Path) -> None:
    # Arrange: a process that made a publish dir dies by SIGKILL (no cleanup runs)
    holder, leaked = _start_holder(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert (leaked / "v1.safetensors").is_file()

    # Act
    fresh = PublishDir(str(tmp_path))

    # Assert
    assert not leaked.exists()
    assert Path(fresh.path).is_dir() and Path(fresh.path).name.startswith(PREFIX)
    fresh.remove()
    assert not Path(fresh.path).exists()


def test_sweep_with_a_live_owner_in_another_process_leaves_its_directory(tmp_path: Path) -> None:
    # Arrange
    holder, live = _start_holder(tmp_path)
    try:
        # Act
        removed = sweep_stale(str(tmp_path))

        # Assert
        assert removed == [] and (live / "v1.safetensors").is_file()
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_sweep_leaves_directories_without_a_lock_file_and_other_names(tmp_path: Path) -> None:
    # Arrange: a directory of an rlsdk from before the lock file, another program's directory, a plain file
    legacy = tmp_path / f"{PREFIX}legacy"
    legacy.mkdir()
    (legacy / "v1.safetensors").write_bytes(b"x")
    other = tmp_path / "someone-else"
    other.mkdir()
    (other / LOCK_NAME).write_text("")
    (tmp_path / f"{PREFIX}file").write_text("not a directory")

    # Act
    removed = sweep_stale(str(tmp_path))

    # Assert
    assert removed == []
    assert legacy.is_dir() and other.is_dir() and (tmp_path / f"{PREFIX}file").is_file()


def test_publish_dir_in_this_process_is_not_swept_until_removed(tmp_path: Path) -> None:
    # Arrange
    first = PublishDir(str(tmp_path))

    # Act: a second Session in the same process creates its own directory (and sweeps)
    second = PublishDir(str(tmp_path))

    # Assert: flock locks are per open file, so the first directory's lock holds against the second sweep; the
    # lock file was locked under a temporary name and renamed (a sweep never sees it unlocked)
    assert Path(first.path).is_dir() and Path(second.path).is_dir()
    assert sorted(os.listdir(first.path)) == [LOCK_NAME]
    first.remove()
    first.remove()  # idempotent
    assert not Path(first.path).exists() and sweep_stale(str(tmp_path)) == []
    second.remove()


def test_sweep_of_a_missing_root_returns_nothing(tmp_path: Path) -> None:
    assert sweep_stale(str(tmp_path / "absent")) == []
