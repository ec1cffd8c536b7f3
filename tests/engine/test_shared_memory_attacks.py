"""Attacks through the paths ranks map or write (docs/security.md): the all-reduce segment named in the process
group's store, and the publish directory. Real files in ``/dev/shm`` (or the temp directory) and a real c10d store
holding what an attacker who reached the store would write."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rlsdk.engine.publish_dir import default_root
from rlsdk.engine.train.shm_allreduce import SharedMemoryAllreduce

pytestmark = pytest.mark.security

SIZE, SLOT = 2, 4096
SEGMENT_BYTES = SIZE * 128 + 2 * SIZE * SLOT
NOBODY = 65534


@pytest.fixture()
def shm_files() -> Iterator[list[Path]]:
    """Files this test makes in the shared-memory root; removed afterwards."""
    made: list[Path] = []
    yield made
    for path in made:
        path.unlink(missing_ok=True)


def _segment_name() -> str:
    return f"rlsdk-allreduce-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _mapped_by_rank_1(path: str) -> SharedMemoryAllreduce | None:
    """Rank 1 of a 2-rank group whose store says the segment is at ``path`` (as rank 0, or an attacker, set)."""
    store = dist.HashStore()
    store.set("rlsdk_shm_allreduce/path", path)
    return SharedMemoryAllreduce.create(store, 1, SIZE, timedelta(seconds=5), slot_bytes=SLOT)


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.write_bytes(b"\0" * SEGMENT_BYTES)
    victim.chmod(0o600)
    return victim


def test_rank_refuses_a_segment_path_outside_the_shared_memory_root(tmp_path: Path) -> None:
    victim = _victim(tmp_path)

    with pytest.raises(PermissionError, match="refused"):
        _mapped_by_rank_1(str(victim))


def test_rank_refuses_a_segment_that_is_a_link_to_another_file(tmp_path: Path, shm_files: list[Path]) -> None:
    victim = _victim(tmp_path)
    link = Path(default_root()) / _segment_name()
    link.symlink_to(victim)
    shm_files.append(link)

    with pytest.raises(PermissionError, match="refused"):
        _mapped_by_rank_1(str(link))

    assert victim.read_bytes() == b"\0" * SEGMENT_BYTES


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's file needs root (chown to nobody)")
def test_rank_refuses_a_segment_owned_by_another_user(shm_files: list[Path]) -> None:
    planted = Path(default_root()) / _segment_name()
    planted.write_bytes(b"\0" * SEGMENT_BYTES)
    os.chown(planted, NOBODY, NOBODY)
    planted.chmod(0o666)
    shm_files.append(planted)

    with pytest.raises(PermissionError, match="owned by uid"):
        _mapped_by_rank_1(str(planted))


def test_rank_refuses_a_segment_others_can_write(shm_files: list[Path]) -> None:
    planted = Path(default_root()) / _segment_name()
    planted.write_bytes(b"\0" * SEGMENT_BYTES)
    planted.chmod(0o666)
    shm_files.append(planted)

    with pytest.raises(PermissionError, match="lets other users in"):
        _mapped_by_rank_1(str(planted))


def test_publishing_weights_into_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_model

    from rlsdk.engine.train.engine import publish_safetensors

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could plant v1.safetensors as a link to a file of yours
    model = torch.nn.Linear(2, 2)

    with pytest.raises(PermissionError, match="no one else may write"):
        publish_safetensors(model.state_dict(), str(shared), 1, lambda tmp: save_model(model, tmp))

    assert list(shared.iterdir()) == []
