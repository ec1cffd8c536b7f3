"""The shared-card GPU weight sync (CUDA IPC) on CPU: packing, the rank command ``share_weights_ipc``, the
controller's verification and its selection; the CUDA handle itself is replaced by the buffer (the real handle
round trip between two processes on one GPU is in tests/gpu)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from rlsdk.config import LaunchConfig
from rlsdk.engine.inference.ipc_sync import IpcRankSide, pack_state_dict, unpack
from rlsdk.engine.inference.weight_transfer import (
    IPC_RANK_COMMAND,
    IPC_WORKER_EXTENSION,
    IpcWeightTransfer,
    NcclWeightTransfer,
    RankCommandTrainer,
    WeightSyncTimeoutError,
    select_weight_transfer,
    weight_transfer_class,
)
from rlsdk.engine.weights import state_dict_checksum
from rlsdk.versioning import WeightMismatchError
from rlsdk.worker.main import Worker


def _state_dict() -> dict[str, torch.Tensor]:
    embed = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    return {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": embed,  # tied: the same tensor under two names, as a checkpoint holds it
        "model.norm.weight": torch.ones(3),
        "model.layers.0.mlp.up_proj.weight": torch.arange(7, dtype=torch.float32).reshape(7, 1),
        "step": torch.tensor([3], dtype=torch.int64),
    }


def test_pack_then_unpack_returns_bit_identical_tensors_at_aligned_offsets_with_the_same_checksum() -> None:
    state_dict = _state_dict()

    buffer, layout = pack_state_dict(state_dict)
    views = unpack(buffer, layout)

    assert [entry["name"] for entry in layout] == sorted(state_dict)
    assert all(entry["offset"] % 256 == 0 for entry in layout)
    for name, tensor in state_dict.items():
        assert views[name].dtype == tensor.dtype and views[name].shape == tensor.shape
        torch.testing.assert_close(views[name], tensor, rtol=0, atol=0)
    assert state_dict_checksum(views) == state_dict_checksum(state_dict)
    assert views["lm_head.weight"].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # views


def test_unpack_when_an_entry_overruns_the_buffer_or_misstates_its_size_raises_naming_it() -> None:
    buffer, layout = pack_state_dict({"w": torch.zeros(4)})

    with pytest.raises(ValueError, match=r"'w': 16 bytes at offset 256 does not fit"):
        unpack(buffer, [{**layout[0], "offset": 256}])
    with pytest.raises(ValueError, match=r"'w': 12 bytes .* float32 tensor of shape \[4\]"):
        unpack(buffer, [{**layout[0], "nbytes": 12}])


class _FakeTrainEngine:
    def __init__(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.state_dict, self.version, self.gathers = state_dict, version, 0

    def full_state_dict(self, *, keep: bool) -> dict[str, torch.Tensor] | None:
        self.gathers += 1  # every rank takes part (a collective with 'fsdp2')
        return dict(self.state_dict) if keep else None


def _shared_card_on_cpu(
    *, trainer_version: int, corrupt: bool = False, worker_error: str | None = None, stall_s: float = 0.0
) -> tuple[IpcWeightTransfer, Any, list[Worker], list[dict[str, Any]]]:
    """Two train ranks (real Worker handlers, fake engines); rank 0 'exports' its CPU buffer itself in place of
    a CUDA handle, and one vLLM worker 'maps' it from the handle and checksums the views as the extension does."""
    state_dict = _state_dict()
    buffers: dict[int, torch.Tensor] = {}

    def exporter(buffer: torch.Tensor) -> dict[str, Any]:
        buffers[id(buffer)] = buffer
        return {"id": id(buffer)}

    workers = [Worker(None, rank, 2) for rank in range(2)]
    for worker in workers:
        worker.engine = _FakeTrainEngine(state_dict, trainer_version)
        worker.ipc = IpcRankSide(worker.rank, device="cpu", exporter=exporter)
    calls: list[dict[str, Any]] = []

    async def call(body: dict[str, Any], timeout_s: float) -> list[Any]:
        calls.append(dict(body))
        return [worker.handlers[IPC_RANK_COMMAND](dict(body)) for worker in workers]

    async def rpc(method: str, kwargs: dict[str, Any], timeout_s: float) -> list[Any]:
        assert method == "rlsdk_ipc_receive"
        await asyncio.sleep(stall_s)
        if worker_error is not None:
            return [{"error": worker_error}]
        views = unpack(buffers[kwargs["handle"]["id"]], kwargs["layout"])
        if corrupt:
            views["model.norm.weight"] = views["model.norm.weight"] + 1
        return [{"checksum": state_dict_checksum(views), "path": f"ipc:v{kwargs['version']}"}]

    return IpcWeightTransfer(call), rpc, workers, calls


def test_ipc_sync_through_the_rank_command_exports_on_rank_zero_verifies_and_releases_the_buffer() -> None:
    transfer, rpc, workers, calls = _shared_card_on_cpu(trainer_version=1)

    loaded = asyncio.run(transfer.push(rpc, "", 1, timeout_s=5.0))

    expected = state_dict_checksum(_state_dict())
    assert loaded["checksum"] == expected and loaded["path"] == "ipc:v1"
    assert transfer.last_sent["checksum"] == expected and transfer.last_sent["version"] == 1
    assert transfer.last_sent["bytes"] == sum(t.numel() * t.element_size() for t in _state_dict().values())
    assert [c["step"] for c in calls] == ["export", "release"]
    assert [w.engine.gathers for w in workers] == [1, 1]  # both ranks gathered
    assert workers[0].ipc._buffer is None and workers[1].ipc._buffer is None  # released


def test_ipc_sync_when_the_worker_loaded_other_bytes_raises_weight_mismatch() -> None:
    transfer, rpc, _, _ = _shared_card_on_cpu(trainer_version=1, corrupt=True)

    with pytest.raises(WeightMismatchError, match="trainer exported checksum"):
        asyncio.run(transfer.push(rpc, "", 1, timeout_s=5.0))


def test_ipc_sync_when_the_trainer_holds_another_version_raises_weight_mismatch_naming_both() -> None:
    transfer, rpc, _, _ = _shared_card_on_cpu(trainer_version=2)

    with pytest.raises(WeightMismatchError, match=r"sync of v1: trainer rank 0 exported v2"):
        asyncio.run(transfer.push(rpc, "", 1, timeout_s=5.0))


def test_ipc_sync_when_the_worker_fails_still_releases_the_buffer_and_raises_its_error() -> None:
    transfer, rpc, workers, calls = _shared_card_on_cpu(trainer_version=1, worker_error="opening the IPC handle")

    with pytest.raises(RuntimeError, match="opening the IPC handle"):
        asyncio.run(transfer.push(rpc, "", 1, timeout_s=5.0))
    assert [c["step"] for c in calls] == ["export", "release"] and workers[0].ipc._buffer is None


def test_ipc_sync_when_the_worker_never_answers_raises_a_bounded_timeout() -> None:
    transfer, rpc, _, _ = _shared_card_on_cpu(trainer_version=1, stall_s=5.0)

    with pytest.raises(WeightSyncTimeoutError, match=r"CUDA IPC weight sync of v1 did not finish within 0.2 s"):
        asyncio.run(transfer.push(rpc, "", 1, timeout_s=0.2))


def test_rank_command_share_weights_ipc_with_an_unknown_step_raises_naming_the_steps() -> None:
    worker = Worker(None, 0, 1)
    worker.engine = _FakeTrainEngine({"w": torch.zeros(1)}, 0)

    with pytest.raises(ValueError, match="unknown step 'bogus'; expected export or release"):
        worker.share_weights_ipc({"step": "bogus"})


def _unused_trainer() -> RankCommandTrainer:
    async def call(body: dict[str, Any], timeout_s: float) -> list[Any]:
        raise AssertionError("selection must not talk to the ranks")

    return RankCommandTrainer(call)


def test_select_weight_transfer_for_a_server_sharing_the_ranks_gpu_picks_cuda_ipc() -> None:
    async def rank_call(command: str, body: dict[str, Any], timeout_s: float) -> list[Any]:
        raise AssertionError("selection must not talk to the ranks")

    one_gpu = LaunchConfig(num_ranks=1, gpus_per_node=1)

    shared = select_weight_transfer(one_gpu, _unused_trainer(), shares_gpu=True, rank_call=rank_call)
    apart = select_weight_transfer(one_gpu, _unused_trainer(), shares_gpu=False)

    assert isinstance(shared, IpcWeightTransfer) and isinstance(apart, NcclWeightTransfer)
    assert tuple(shared.server_args()) == ("--worker-extension-cls", IPC_WORKER_EXTENSION)
    assert weight_transfer_class(one_gpu, "reload", shares_gpu=True).name == "file"  # an explicit choice wins
    with pytest.raises(ValueError, match="needs rank_call"):
        select_weight_transfer(one_gpu, _unused_trainer(), shares_gpu=True)


def test_ipc_worker_extension_class_is_importable_by_the_name_the_server_gets() -> None:
    import importlib

    module, _, name = IPC_WORKER_EXTENSION.rpartition(".")

    extension = getattr(importlib.import_module(module), name)

    assert callable(extension.rlsdk_ipc_receive) and callable(extension.rlsdk_load_weights)
