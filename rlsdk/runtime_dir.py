"""Private places on disk: a per-session 0700 runtime directory for sockets, and private directories for output.

Other users of the machine are untrusted (docs/security.md). What a run keeps on disk that another user could use
against it (Unix sockets of the control channel and of a started vLLM server, published weights, checkpoints,
logs) lives in directories only this user can enter, as Jupyter keeps its kernels' connection files in a 0700
runtime directory. A socket in such a directory cannot be connected to by another user whatever the socket's own
mode, so no port is opened where a Unix socket serves.

:class:`SessionRuntimeDir` is made fresh for each Session (``mkdtemp``: 0700, a name no one else can predict or
pre-create) under ``$XDG_RUNTIME_DIR`` when that is a private directory of this user, else the temp directory.
:func:`private_dir` creates or checks a directory the user named (``observe.output_dir`` and what is under it):
created 0700, and an existing one that another user owns, or that is a symbolic link, is refused.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

# The standard library's logger for this module: the one rlsdk.observe.logging.get_logger(__name__) returns (under
# 'rlsdk'); the project logger writes its files through private_dir/private_file, so it cannot be imported here.
logger = logging.getLogger(__name__)

PREFIX = "rlsdk-run-"
# sun_path holds 108 bytes on Linux including the terminating NUL; longer socket paths cannot be bound.
MAX_SOCKET_PATH = 107


class InsecureDirectoryError(PermissionError):
    """A directory rlsdk would keep private files in is a link, or is owned by another user."""


def private_dir(path: str | os.PathLike[str], *, mode: int = 0o700) -> Path:
    """Create ``path`` (and missing parents, with the same ``mode``) or check an existing one; return it.

    A directory created here gets ``mode`` whatever the umask. An existing directory is used as it is (the
    user may have opened it up on purpose) but must be a real directory owned by this user.

    Raises:
        InsecureDirectoryError: ``path`` is a symbolic link, not a directory, or owned by another user.
    """
    directory = Path(path)
    missing = []
    probe = directory
    while not probe.exists() and not probe.is_symlink():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for created in reversed(missing):
        try:
            created.mkdir(mode=mode)
        except FileExistsError:
            pass
        else:
            os.chmod(created, mode)  # mkdir's mode is masked by the umask
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise InsecureDirectoryError(f"{directory} must be a directory, not a link or a file")
    if info.st_uid != os.getuid():
        raise InsecureDirectoryError(f"{directory} is owned by uid {info.st_uid}, not by this user ({os.getuid()})")
    return directory


def output_modes(output_mode: str) -> tuple[int, int]:
    """``(directory mode, file mode)`` of ``observe.output_mode`` (an octal string such as ``"0700"``): files get
    the directory bits without execute (``0700`` -> ``0600``)."""
    mode = int(output_mode, 8)
    return mode, mode & 0o666


def private_file(path: str | os.PathLike[str], mode: int = 0o600, *, append: bool = False) -> int:
    """Open ``path`` for writing (created with ``mode`` whatever the umask; truncated unless ``append``), never
    through a symbolic link; returns the descriptor (wrap it with :func:`os.fdopen`).

    Raises:
        OSError: as :func:`os.open` (``ELOOP`` for a link).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, mode)
    try:
        if os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, mode)  # os.open's mode is masked by the umask, and ignored for an existing file
    except OSError:
        os.close(fd)
        raise
    return fd


def restrict_tree(root: str | os.PathLike[str], dir_mode: int = 0o700, file_mode: int = 0o600) -> None:
    """Set ``dir_mode`` on ``root`` and every directory under it and ``file_mode`` on every regular file (files a
    library wrote under the process umask, e.g. a tokenizer's ``save_pretrained``). Links are not followed."""
    if os.path.islink(root):
        raise InsecureDirectoryError(f"{root} is a symbolic link")
    for current, _dirs, files in os.walk(root):  # os.walk never descends into linked directories
        os.chmod(current, dir_mode)
        for name in files:
            path = os.path.join(current, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.chmod(path, file_mode)


def socket_path(directory: str, name: str) -> str:
    """The path of a Unix socket named ``name`` in ``directory``.

    Raises:
        ValueError: ``name`` is not a plain file name, or the path is too long for a Unix socket (set ``TMPDIR``
            or ``XDG_RUNTIME_DIR`` to a shorter directory).
    """
    if not name or "/" in name or name in {".", ".."}:
        raise ValueError(f"socket name {name!r} must be a plain file name")
    path = os.path.join(directory, name)
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ValueError(
            f"Unix socket path {path!r} is {len(os.fsencode(path))} bytes, more than the {MAX_SOCKET_PATH} a "
            "socket address holds: set TMPDIR (or XDG_RUNTIME_DIR) to a shorter directory"
        )
    return path


def _runtime_root() -> str:
    """``$XDG_RUNTIME_DIR`` when it is a 0700 directory of this user (systemd's /run/user/UID), else the temp dir."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            info = os.lstat(xdg)
        except OSError:
            info = None
        if (
            info is not None
            and stat.S_ISDIR(info.st_mode)
            and info.st_uid == os.getuid()
            and stat.S_IMODE(info.st_mode) & 0o077 == 0
        ):
            return xdg
    return tempfile.gettempdir()


class SessionRuntimeDir:
    """A fresh 0700 directory for one Session's Unix sockets and other private runtime files.

    Args:
        root: where to create it; ``None`` = ``$XDG_RUNTIME_DIR`` if private, else the temp directory.

    Raises:
        OSError: the directory cannot be created.
    """

    def __init__(self, root: str | None = None) -> None:
        self.path = tempfile.mkdtemp(prefix=PREFIX, dir=_runtime_root() if root is None else root)  # mode 0700

    def socket_path(self, name: str) -> str:
        """The path of a Unix socket named ``name`` in this directory.

        Raises:
            ValueError: ``name`` is not a plain file name, or the path is too long for a Unix socket (set
                ``TMPDIR`` or ``XDG_RUNTIME_DIR`` to a shorter directory).
        """
        return socket_path(self.path, name)

    def remove(self) -> None:
        """Delete the directory and everything in it; idempotent."""
        shutil.rmtree(self.path, ignore_errors=True)
