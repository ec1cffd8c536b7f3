"""The canonical checkpoint layout, its atomic finalisation, and the checks before anything of it is loaded.

``OUTPUT/checkpoints/step_N/`` holds ``model/`` (a loadable transformers directory), ``trainer_state.pt``
(optimizer, version, weights checksum), ``rng_rank{r}.pt`` per rank, ``ledger.json``, ``config.yaml``,
``data_state.json``, ``session.json`` (step and rollout counters), ``manifest.json`` (SHA-256 and size of every
other file) and ``manifest.sig`` (an HMAC of the manifest under the user's key,
:mod:`rlsdk.engine.train.checkpoint_signing`). Ranks write into ``step_N.tmp-*``; the controller fsyncs and
renames it, so a ``step_N`` directory is either complete or absent. :func:`resolve_checkpoint` finds and verifies
one to resume from (``train.resume_from``).

A checkpoint is input that can run code (a pickle, a model directory), so before any of it is read
:func:`verify_checkpoint` checks, in this order: the manifest's signature (nothing else is opened before it
passes); that every manifest entry is a plain relative path that stays inside the directory (no absolute path,
no ``..``, no symbolic link on the way); that the directory holds exactly the listed files (a file the manifest
does not list is refused: transformers would load e.g. a stray ``pytorch_model.bin``); then every file's size and
SHA-256. Everything a rank loads with ``torch.load`` uses ``weights_only=True``; the RNG states are stored as
plain ints, lists and tensors, which need nothing beyond torch's default allow-list (:func:`rng_state`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import stat
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from rlsdk.engine.train.checkpoint_signing import (
    SIGNATURE_NAME,
    CheckpointTrustError,
    check_signature,
    load_key,
    read_small_file,
    write_signature,
)

MANIFEST_NAME = "manifest.json"
# A manifest lists a few lines per file; a sharded 70B model has a few hundred files.
MAX_MANIFEST_BYTES = 64 << 20
RNG_FORMAT = 2  # plain values only; 1 (unversioned): numpy's state as an ndarray


class CheckpointError(ValueError):
    """A checkpoint's files do not match its manifest, or the manifest names a path it must not."""


def rng_state() -> dict[str, Any]:
    """The python, numpy and torch (CPU) generator states as plain values (ints, floats, a str, lists and a
    uint8 tensor): ``torch.load(weights_only=True)`` reads them back with torch's default allow-list, where numpy's
    own state (an ndarray) would need numpy's array reconstructor allowed for every file loaded alongside."""
    import numpy as np

    python_version, python_internal, python_gauss = random.getstate()
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "format": RNG_FORMAT,
        "python": [python_version, list(python_internal), python_gauss],
        "numpy": [str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached_gaussian)],
        "torch": torch.get_rng_state(),
    }


def _legacy_rng_globals() -> list[Any]:
    """Exactly what an RNG file from before :data:`RNG_FORMAT` 2 needs (numpy's state as an ndarray)."""
    import numpy as np

    reconstruct = np._core.multiarray._reconstruct  # type: ignore[attr-defined]
    # Written under numpy 1 the reconstructor is named numpy.core.multiarray._reconstruct.
    # UInt32DType: the state's dtype, restored by BUILD (not named as a global in the file).
    return [
        reconstruct,
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        np.dtypes.UInt32DType,
    ]


def load_rng_state(path: Path) -> None:
    """Restore the python, numpy and torch (CPU) generators from a file :func:`rng_state` wrote.

    ``torch.load(weights_only=True)``: nothing but plain values and tensors is unpickled. A file from before
    :data:`RNG_FORMAT` 2 holds numpy's state as an ndarray; it loads with numpy's array reconstructor, ``ndarray``,
    ``dtype`` and the uint32 dtype allowed for that one call (torch's ``safe_globals``) when those are all it
    names.

    Raises:
        pickle.UnpicklingError: the file needs anything else unpickled (a crafted file); nothing of it runs.
        ValueError: the file does not hold generator states.
    """
    import numpy as np

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        needed = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        legacy = {"numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct"}
        legacy |= {"numpy.ndarray", "numpy.dtype"}
        if not needed <= legacy:
            raise pickle.UnpicklingError(
                f"{path} is not an RNG state file rlsdk wrote: it needs {sorted(needed - legacy)} unpickled, "
                "which is refused (weights_only=True)"
            ) from None
        with torch.serialization.safe_globals(_legacy_rng_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    try:
        python, numpy_state, torch_state = state["python"], state["numpy"], state["torch"]
        if state.get("format") == RNG_FORMAT:
            python = (int(python[0]), tuple(int(x) for x in python[1]), python[2])
            numpy_state = (str(numpy_state[0]), np.asarray(numpy_state[1], dtype=np.uint32), *numpy_state[2:])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} does not hold the generator states rlsdk writes ({exc})") from exc
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    for directory in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where that is unsupported."""
    import ctypes
    import errno

    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def _manifest_entries(tmp_dir: Path) -> dict[str, dict[str, Any]]:
    return {
        p.relative_to(tmp_dir).as_posix(): {"sha256": _sha256(p), "bytes": p.stat().st_size}
        for p in sorted(tmp_dir.rglob("*"))
        if p.is_file()
    }


def finalize_checkpoint(tmp_dir: Path, final_dir: Path, extra_files: dict[str, str]) -> Path:
    """Write ``extra_files`` (name -> text), ``manifest.json`` and its signature into ``tmp_dir``, fsync, rename
    to final."""
    for name, text in extra_files.items():
        (tmp_dir / name).write_text(text, encoding="utf-8")
    manifest = json.dumps({"files": _manifest_entries(tmp_dir)}, indent=1).encode("utf-8")
    (tmp_dir / MANIFEST_NAME).write_bytes(manifest)
    write_signature(tmp_dir, manifest, load_key())
    _fsync_tree(tmp_dir)
    if final_dir.exists() and _exchange(tmp_dir, final_dir):
        # Re-saving the same step: the new copy took the old one's place in one atomic step; the old one now
        # sits at the temporary name, which is never taken for a checkpoint, until it is removed.
        shutil.rmtree(tmp_dir)
    else:
        if final_dir.exists():  # no atomic exchange on this filesystem: a kill here loses this step
            shutil.rmtree(final_dir)
        os.replace(tmp_dir, final_dir)
    fd = os.open(final_dir.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final_dir


def _checked_member(directory: Path, name: Any) -> Path:
    """``directory / name`` for a manifest entry that names a regular file inside ``directory`` without leaving it.

    Raises ``CheckpointError`` for an absolute path, an empty, ``.`` or ``..`` component, a symbolic link on the
    way, or something that is not a regular file.
    """
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"checkpoint {directory}: manifest entry {name!r} is not a file name")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or any(part in ("", ".", "..") for part in parts) or "//" in name:
        raise CheckpointError(
            f"checkpoint {directory}: manifest entry {name!r} leaves the checkpoint directory (absolute or '..')"
        )
    path = directory
    for index, part in enumerate(parts):
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {directory}: {name} is listed in manifest.json but missing") from None
        if stat.S_ISLNK(mode):
            raise CheckpointError(f"checkpoint {directory}: {name} goes through a symbolic link ({path})")
        last = index == len(parts) - 1
        if (last and not stat.S_ISREG(mode)) or (not last and not stat.S_ISDIR(mode)):
            raise CheckpointError(f"checkpoint {directory}: {name} is not a regular file")
    return path


def _unlisted(directory: Path, listed: set[str]) -> list[str]:
    """Names of every entry under ``directory`` that is not a listed file, a directory on the way to one, or
    the manifest and its signature; links and special files are always in it."""
    found: list[str] = []
    for root, dirs, files in os.walk(directory, followlinks=False):
        for entry in [*dirs, *files]:
            path = Path(root) / entry
            name = path.relative_to(directory).as_posix()
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode) or name not in listed:
                found.append(name)
    return sorted(set(found) - {MANIFEST_NAME, SIGNATURE_NAME})


def _read_manifest(directory: Path) -> tuple[bytes, dict[str, Any]]:
    """The manifest's bytes and its parsed ``files`` table, the signature checked before the bytes are parsed."""
    raw = read_small_file(directory / MANIFEST_NAME, MAX_MANIFEST_BYTES)
    check_signature(directory, raw)
    files = json.loads(raw)["files"]
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {directory}: manifest.json 'files' is not a table")
    return raw, files


def verify_checkpoint(directory: Path, *, signed: bool = True) -> dict[str, Any]:
    """Check a checkpoint before anything of it is loaded; return its manifest's ``files`` table.

    In this order: the manifest's signature under this user's key (``signed``; nothing else is opened before it
    passes), every entry a plain relative path to a regular file inside ``directory`` reached without a symbolic
    link, no file the manifest does not list, then every file's size and SHA-256.

    Raises:
        CheckpointTrustError: unsigned, signed with another key, or a manifest changed after signing
            (``rlsdk checkpoint sign DIR`` trusts it).
        CheckpointError: a path that leaves the directory, an unlisted file, a missing file or one whose size or
            checksum does not match (names the file).
        ValueError: a malformed manifest.
    """
    directory = Path(directory)
    if signed:
        _, files = _read_manifest(directory)
    else:
        files = json.loads(read_small_file(directory / MANIFEST_NAME, MAX_MANIFEST_BYTES))["files"]
    paths = {name: _checked_member(directory, name) for name in files}
    unlisted = _unlisted(directory, set(files))
    if unlisted:
        shown = ", ".join(unlisted[:5]) + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")
        raise CheckpointError(f"checkpoint {directory} holds files manifest.json does not list: {shown}")
    for name, entry in files.items():
        path = paths[name]
        if path.stat().st_size != entry["bytes"] or _sha256(path) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {directory}: {name} does not match its manifest checksum")
    return files


def sign_checkpoint(directory: str | os.PathLike[str]) -> Path:
    """Trust a checkpoint: check it (paths, no unlisted file, every checksum) and sign its manifest with this
    user's key, so :func:`verify_checkpoint` accepts it. For a checkpoint someone else wrote, or an older rlsdk.

    Raises what :func:`verify_checkpoint` raises for a checkpoint whose files do not match its manifest
    (``signed=False``: the signature being replaced is not checked); ``FileNotFoundError`` without a manifest.
    """
    path = Path(directory)
    verify_checkpoint(path, signed=False)
    write_signature(path, read_small_file(path / MANIFEST_NAME, MAX_MANIFEST_BYTES), load_key())
    return path


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete ``step_N`` directories under ``root``, oldest first (``step_N.tmp-*`` partials excluded)."""
    if not root.is_dir():
        return []
    steps = (p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())
    return sorted(steps, key=lambda p: int(p.name[5:]))


def resolve_checkpoint(resume_from: str, output_dir: Path) -> Path:
    """The checkpoint directory ``train.resume_from`` names, verified against its manifest.

    ``'latest'``: the newest complete ``step_N`` under ``output_dir/checkpoints``. Raises ``ConfigError`` naming
    ``train.resume_from`` when there is none, the directory is missing, has no manifest.json, is not signed with
    this user's key, or fails any check of :func:`verify_checkpoint` (every file is hashed: seconds per GB).
    """
    from rlsdk.config import ConfigError

    field = "train.resume_from"
    if resume_from == "latest":
        root = output_dir / "checkpoints"
        found = complete_checkpoints(root)
        if not found:
            raise ConfigError(field, resume_from, f"'latest' needs a complete step_N checkpoint under {root}")
        directory = found[-1]
    else:
        directory = Path(resume_from).expanduser()
    if not directory.is_dir():
        raise ConfigError(field, resume_from, "an existing step_N checkpoint directory (or 'latest')")
    if not (directory / "manifest.json").is_file():
        raise ConfigError(
            field, resume_from, "a complete checkpoint directory with manifest.json (a step_N, not a .tmp-*)"
        )
    try:
        verify_checkpoint(directory)
    except (CheckpointTrustError, PermissionError) as exc:  # PermissionError: the key file itself
        raise ConfigError(field, resume_from, f"a checkpoint signed with your key ({exc})") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(field, resume_from, f"a checkpoint whose files match manifest.json ({exc})") from exc
    return directory


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete ``step_N`` directories (and stale temporaries)."""
    steps = complete_checkpoints(root)
    removed = steps[:-keep] if keep > 0 else []
    removed += [p for p in root.glob("step_*.tmp-*") if p.is_dir()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
