"""Who wrote this checkpoint? An HMAC over its manifest under a key only this user holds.

A checkpoint's ``manifest.json`` lists the SHA-256 of every file, but anyone who can hand you a directory can write
a matching manifest. So the controller signs the manifest's exact bytes with HMAC-SHA256 under the user's
checkpoint key and writes the tag to ``manifest.sig``; a resume checks that tag before it parses the manifest or
opens any other file, so a checkpoint someone else wrote or changed is refused before a byte of it is read. The
same idea as SSH's private key or Jupyter's notebook signatures: a secret only this user can read
(``$XDG_CACHE_HOME/rlsdk/checkpoint.key``, default ``~/.cache/rlsdk/checkpoint.key``: 0600 in a 0700 directory,
created on first use, refused when group or others can read it).

A checkpoint from another user or machine (or written before rlsdk signed checkpoints) is trusted explicitly,
one directory at a time, with ``rlsdk checkpoint sign DIR``, which checks the files against the manifest and signs
it with this user's key. Copying the key file to another machine of yours makes your checkpoints resumable there
as they are.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path

KEY_NAME = "checkpoint.key"
SIGNATURE_NAME = "manifest.sig"
ALGORITHM = "hmac-sha256"
KEY_BYTES = 32
# manifest.sig holds one small JSON object; anything larger is not one.
MAX_SIGNATURE_BYTES = 4096


class CheckpointTrustError(ValueError):
    """A checkpoint is unsigned, signed with another key, or its manifest changed after it was signed."""


def key_path() -> Path:
    """Where this user's checkpoint key lives: ``$XDG_CACHE_HOME/rlsdk/checkpoint.key`` (``~/.cache`` when the
    variable is unset, empty or relative, as the XDG base directory specification says)."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):
        cache = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "rlsdk" / KEY_NAME


def _open_regular(path: Path, error: type[Exception]) -> tuple[int, os.stat_result]:
    """An fd of ``path`` opened without following a link, and its stat; ``error`` when it is a link or not a
    regular file (``FileNotFoundError`` passes through)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise error(f"{path} is a symbolic link or cannot be opened ({exc})") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise error(f"{path} is not a regular file")
    return fd, info


def _read_key(path: Path) -> bytes:
    fd, info = _open_regular(path, PermissionError)
    try:
        if info.st_uid != os.getuid():
            raise PermissionError(f"checkpoint key {path} is owned by uid {info.st_uid}, not by you ({os.getuid()})")
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise PermissionError(
                f"checkpoint key {path} has mode {stat.S_IMODE(info.st_mode):o}: anyone who can read it can sign "
                f"checkpoints as you. Run `chmod 600 {path}` (a new key would make your checkpoints untrusted)"
            )
        text = os.read(fd, 4 * KEY_BYTES).decode("ascii", errors="replace").strip()
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise PermissionError(f"checkpoint key {path} does not hold {KEY_BYTES} hex-encoded bytes")
    return key


def load_key(*, create: bool = True) -> bytes:
    """This user's checkpoint key; with ``create``, made on first use (256 random bits, hex, in a 0600 file).

    Raises:
        PermissionError: the key file is a link, another user's, readable by group or others, or malformed.
        FileNotFoundError: there is no key and ``create`` is False.
    """
    from rlsdk.runtime_dir import private_dir

    path = key_path()
    if not create or path.exists() or path.is_symlink():
        return _read_key(path)
    private_dir(path.parent)
    # Written in full under a temporary name, then linked into place: a concurrent first use never reads a
    # half-written key, and exactly one key wins (link fails when the name exists).
    pending = path.with_name(f".{KEY_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (secrets.token_bytes(KEY_BYTES).hex() + "\n").encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        with contextlib.suppress(FileExistsError):
            os.link(pending, path)
    finally:
        os.unlink(pending)
    return _read_key(path)


def key_id(key: bytes) -> str:
    """A short public name of ``key`` (a hash of it), so errors can say which key signed a checkpoint."""
    return hashlib.sha256(b"rlsdk checkpoint key id\0" + key).hexdigest()[:16]


def signature_record(manifest: bytes, key: bytes) -> str:
    """The text of ``manifest.sig`` for the manifest bytes ``manifest``."""
    tag = hmac.new(key, manifest, hashlib.sha256).hexdigest()
    return json.dumps({"algorithm": ALGORITHM, "key_id": key_id(key), "hmac": tag}) + "\n"


def write_signature(directory: Path, manifest: bytes, key: bytes) -> None:
    """Write ``directory/manifest.sig`` for ``manifest`` atomically (0600)."""
    path = directory / SIGNATURE_NAME
    pending = directory / f".{SIGNATURE_NAME}.tmp-{secrets.token_hex(4)}"
    fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, signature_record(manifest, key).encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(pending, path)


def read_small_file(path: Path, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (not a link), at most ``limit`` of them.

    Raises:
        CheckpointTrustError: ``path`` is a link or not a regular file, or larger than ``limit``.
        FileNotFoundError: it does not exist.
    """
    fd, info = _open_regular(path, CheckpointTrustError)
    try:
        if info.st_size > limit:
            raise CheckpointTrustError(f"{path} has {info.st_size} bytes, more than the {limit} allowed")
        chunks, size = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise CheckpointTrustError(f"{path} grew past the {limit} bytes allowed while it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def check_signature(directory: Path, manifest: bytes) -> None:
    """Check ``directory/manifest.sig`` against the manifest bytes ``manifest`` under this user's key.

    Raises:
        CheckpointTrustError: no signature (an older rlsdk's checkpoint, or another tool's), a signature under
            another key (another user or machine), or one that does not match (the manifest changed after it was
            signed). Each message says how to trust the checkpoint if you do: ``rlsdk checkpoint sign DIR``.
    """
    trust = f"If you trust this checkpoint (you know who wrote it), run: rlsdk checkpoint sign {directory}"
    try:
        raw = read_small_file(directory / SIGNATURE_NAME, MAX_SIGNATURE_BYTES)
    except FileNotFoundError:
        raise CheckpointTrustError(
            f"checkpoint {directory} is not signed (no {SIGNATURE_NAME}): it was written before rlsdk signed its "
            f"checkpoints, or by someone else, and resuming loads code-bearing files from it. {trust}"
        ) from None
    try:
        record = json.loads(raw)
        algorithm, signer, tag = record["algorithm"], str(record["key_id"]), str(record["hmac"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointTrustError(f"checkpoint {directory}: {SIGNATURE_NAME} is malformed ({exc}). {trust}") from exc
    if algorithm != ALGORITHM:
        raise CheckpointTrustError(
            f"checkpoint {directory}: {SIGNATURE_NAME} uses {algorithm!r}; rlsdk checks {ALGORITHM!r}. {trust}"
        )
    key = load_key()
    mine = key_id(key)
    if signer != mine:
        raise CheckpointTrustError(
            f"checkpoint {directory} was signed with another key (id {signer}; yours, {key_path()}, is {mine}): it "
            f"comes from another user or machine. {trust}, or copy your key to the machine that wrote it"
        )
    expected = hmac.new(key, manifest, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, tag):
        raise CheckpointTrustError(
            f"checkpoint {directory}: manifest.json does not match its signature: it was changed after rlsdk "
            f"wrote it. {trust}"
        )
