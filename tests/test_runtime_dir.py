"""rlsdk.runtime_dir: the per-session 0700 runtime directory and private output directories."""

from __future__ import annotations

import os
import stat

import pytest

from rlsdk.runtime_dir import MAX_SOCKET_PATH, InsecureDirectoryError, SessionRuntimeDir, private_dir


def test_session_runtime_dir_is_created_private_and_removed(tmp_path):
    runtime = SessionRuntimeDir(root=str(tmp_path))

    mode = stat.S_IMODE(os.stat(runtime.path).st_mode)
    runtime.remove()

    assert mode == 0o700
    assert not os.path.exists(runtime.path)
    runtime.remove()  # idempotent


def test_session_runtime_dir_socket_path_with_a_path_name_raises_value_error(tmp_path):
    runtime = SessionRuntimeDir(root=str(tmp_path))

    with pytest.raises(ValueError, match="plain file name"):
        runtime.socket_path("../x.sock")
    runtime.remove()


def test_session_runtime_dir_socket_path_too_long_for_a_unix_socket_raises_naming_the_limit(tmp_path):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    runtime = SessionRuntimeDir(root=str(deep))

    with pytest.raises(ValueError, match=str(MAX_SOCKET_PATH)):
        runtime.socket_path("control.sock")
    runtime.remove()


def test_private_dir_creates_missing_parents_0700_whatever_the_umask(tmp_path):
    old = os.umask(0o000)
    try:
        created = private_dir(tmp_path / "out" / "run" / "logs")
    finally:
        os.umask(old)

    modes = [stat.S_IMODE(os.stat(p).st_mode) for p in (tmp_path / "out", tmp_path / "out" / "run", created)]

    assert modes == [0o700, 0o700, 0o700]


def test_private_dir_keeps_an_existing_directory_mode_chosen_by_the_user(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)

    private_dir(shared)

    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o755


def test_private_dir_on_a_symlink_raises_insecure_directory_error(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)

    with pytest.raises(InsecureDirectoryError, match="link"):
        private_dir(link)
