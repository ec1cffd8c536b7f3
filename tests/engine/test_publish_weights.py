"""publish_safetensors: the trainer's published weights file, rewritten in place from the second version on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, load_model, save_model

from rlsdk.engine.inference import vllm_worker
from rlsdk.engine.train.engine import publish_safetensors
from rlsdk.engine.weights import state_dict_checksum


class _Tied(torch.nn.Module):
    def __init__(self, seed: int = 0, hidden: int = 8) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(16, hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, 16, bias=False)
        self.head.weight = self.embed.weight  # tied: save_model keeps one name, the other in the metadata


def _publish(model: torch.nn.Module, directory: Path, version: int) -> str:
    return publish_safetensors(model.state_dict(), str(directory), version, lambda tmp: save_model(model, tmp))


def test_publish_rewrites_the_previous_file_in_place_and_renames_it_to_the_new_version(tmp_path: Path) -> None:
    model = _Tied()
    first = _publish(model, tmp_path, 1)
    inode = os.stat(first).st_ino
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    second = _publish(model, tmp_path, 2)

    assert second == str(tmp_path / "v2.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2.safetensors"]
    assert os.stat(second).st_ino == inode
    loaded = _Tied(seed=1)
    load_model(loaded, second)  # still a normal safetensors file, tied names restored
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0.0, atol=0.0)
    assert state_dict_checksum(loaded.state_dict()) == state_dict_checksum(model.state_dict())


def test_publish_of_the_same_version_again_rewrites_that_file_without_renaming(tmp_path: Path) -> None:
    model = _Tied()
    path = _publish(model, tmp_path, 3)

    again = _publish(model, tmp_path, 3)

    assert again == path and sorted(p.name for p in tmp_path.iterdir()) == ["v3.safetensors"]


def test_publish_with_a_changed_layout_writes_a_new_file_and_deletes_the_old_one(tmp_path: Path) -> None:
    first = _publish(_Tied(hidden=8), tmp_path, 1)
    inode = os.stat(first).st_ino
    wider = _Tied(hidden=12)

    second = _publish(wider, tmp_path, 2)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2.safetensors"]
    assert os.stat(second).st_ino != inode
    assert load_file(second)["proj.weight"].shape == (12, 12)


def test_publish_with_broken_tie_writes_a_new_file_holding_both_tensors(tmp_path: Path) -> None:
    model = _Tied()
    _publish(model, tmp_path, 1)
    model.head.weight = torch.nn.Parameter(model.embed.weight.detach().clone() + 1.0)

    path = _publish(model, tmp_path, 2)

    stored = load_file(path)
    torch.testing.assert_close(stored["head.weight"], model.head.weight.detach(), rtol=0.0, atol=0.0)
    torch.testing.assert_close(stored["embed.weight"], model.embed.weight.detach(), rtol=0.0, atol=0.0)


def test_worker_mapping_kept_across_an_in_place_publish_shows_the_new_version(tmp_path: Path) -> None:
    model = _Tied()
    path = _publish(model, tmp_path, 1)
    published = vllm_worker.PublishedFile(path, keep_mapped=True)
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-2.0)
        new_path = _publish(model, tmp_path, 2)

        assert published.still_maps(new_path)
        torch.testing.assert_close(published.tensors["proj.weight"], model.proj.weight.detach(), rtol=0.0, atol=0.0)
        assert not published.still_maps(path)  # the old name is gone
    finally:
        published.close()


def test_worker_mapping_is_not_reused_for_a_new_file_at_the_same_path(tmp_path: Path) -> None:
    model = _Tied()
    path = _publish(model, tmp_path, 1)
    published = vllm_worker.PublishedFile(path, keep_mapped=True)
    try:
        os.unlink(path)
        save_model(model, path)  # same name and bytes, another inode

        assert not published.still_maps(path)
    finally:
        published.close()


@pytest.mark.parametrize("keep_mapped", [False, True])
def test_published_file_read_into_copies_the_tensor_bytes_either_way(tmp_path: Path, keep_mapped: bool) -> None:
    model = _Tied()
    path = _publish(model, tmp_path, 1)
    published = vllm_worker.PublishedFile(path, keep_mapped=keep_mapped)
    try:
        dst = torch.zeros_like(model.proj.weight)

        name = published.read_into(dst, published.tensors["proj.weight"])

        assert name == "proj.weight" and published.direct_bytes == dst.numel() * 4
        torch.testing.assert_close(dst, model.proj.weight.detach(), rtol=0.0, atol=0.0)
    finally:
        published.close()
