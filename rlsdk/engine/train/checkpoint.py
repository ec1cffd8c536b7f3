"""The canonical checkpoint layout and its atomic finalisation.

``OUTPUT/checkpoints/step_N/`` holds ``model/`` (a loadable transformers directory), ``trainer_state.pt``
(optimizer, version), ``rng_rank{r}.pt`` per rank, ``ledger.json``, ``config.yaml`` and ``manifest.json``
(SHA-256 of every file). Ranks write into ``step_N.tmp-*``; the controller fsyncs and renames it, so a
``step_N`` directory is either complete or absent.
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
    if final_dir.exists():
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


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete ``step_N`` directories (and stale temporaries)."""
    steps = sorted(
        (p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()), key=lambda p: int(p.name[5:])
    )
    removed = steps[:-keep] if keep > 0 else []
    removed += [p for p in root.glob("step_*.tmp-*") if p.is_dir()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
