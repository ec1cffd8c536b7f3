"""The canonical checkpoint layout and its atomic finalisation.

``OUTPUT/checkpoints/step_N/`` holds ``model/`` (a loadable transformers directory), ``trainer_state.pt``
(optimizer, version, weights checksum), ``rng_rank{r}.pt`` per rank, ``ledger.json``, ``config.yaml``,
``data_state.json``, ``session.json`` (step and rollout counters) and ``manifest.json`` (SHA-256 of every file).
Ranks write into ``step_N.tmp-*``; the controller fsyncs and renames it, so a ``step_N`` directory is either
complete or absent. :func:`resolve_checkpoint` finds and verifies one to resume from (``train.resume_from``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    import numpy as np

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def load_rng_state(path: Path) -> None:
    """Restore the python, numpy and torch (CPU) generators from a file :func:`rng_state` wrote."""
    import numpy as np

    # weights_only=False: numpy's state is an ndarray; the file was verified against the checkpoint's manifest.
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


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


def finalize_checkpoint(tmp_dir: Path, final_dir: Path, extra_files: dict[str, str]) -> Path:
    """Write ``extra_files`` (name -> text) and ``manifest.json`` into ``tmp_dir``, fsync, rename to final."""
    for name, text in extra_files.items():
        (tmp_dir / name).write_text(text, encoding="utf-8")
    manifest = {
        str(p.relative_to(tmp_dir)): {"sha256": _sha256(p), "bytes": p.stat().st_size}
        for p in sorted(tmp_dir.rglob("*"))
        if p.is_file()
    }
    (tmp_dir / "manifest.json").write_text(json.dumps({"files": manifest}, indent=1), encoding="utf-8")
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


def verify_checkpoint(directory: Path) -> None:
    """Raise ``ValueError`` naming the first file whose checksum does not match the manifest."""
    manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))["files"]
    for name, entry in manifest.items():
        path = directory / name
        if not path.is_file():
            raise ValueError(f"checkpoint {directory}: {name} is listed in manifest.json but missing")
        if _sha256(path) != entry["sha256"]:
            raise ValueError(f"checkpoint {directory}: {name} does not match its manifest checksum")


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete ``step_N`` directories under ``root``, oldest first (``step_N.tmp-*`` partials excluded)."""
    if not root.is_dir():
        return []
    steps = (p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())
    return sorted(steps, key=lambda p: int(p.name[5:]))


def resolve_checkpoint(resume_from: str, output_dir: Path) -> Path:
    """The checkpoint directory ``train.resume_from`` names, verified against its manifest.

    ``'latest'``: the newest complete ``step_N`` under ``output_dir/checkpoints``. Raises ``ConfigError`` naming
    ``train.resume_from`` when there is none, the directory is missing, has no manifest.json, or a file is
    missing or does not match its manifest checksum (every file is hashed: seconds per GB).
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
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
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
