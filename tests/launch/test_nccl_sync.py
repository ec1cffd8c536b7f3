"""The GPU weight-sync path: its controller half and timeout on CPU; the NCCL broadcast itself on GPUs only."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from rlsdk.engine.inference.nccl_sync import (
    NcclRendezvous,
    NcclWeightTransfer,
    WeightSyncTimeoutError,
    call_with_timeout,
    layout_bytes,
    tensor_layout,
)
from rlsdk.engine.weights import state_dict_checksum
from rlsdk.versioning import WeightMismatchError


def _state_dict() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "lm_head.weight": torch.randn(8, 4, generator=generator, dtype=torch.float32),
        "model.embed.weight": torch.randn(8, 4, generator=generator, dtype=torch.bfloat16),
    }


class _FakeTrainer:
    """Trainer rank 0 as the controller sees it; 'sends' a state dict by handing it to the fake workers."""

    def __init__(self, state_dict: dict[str, torch.Tensor], *, hang: bool = False) -> None:
        self.state_dict = state_dict
        self.hang = hang
        self.joined = 0
        self.wire: asyncio.Queue[dict[str, torch.Tensor]] = asyncio.Queue()

    async def join(self, rendezvous: NcclRendezvous, timeout_s: float) -> None:
        self.joined += 1

    async def address(self, timeout_s: float) -> tuple[str, int]:
        return "127.0.0.1", 29600

    async def layout(self, version: int, timeout_s: float) -> list[dict[str, Any]]:
        return tensor_layout(self.state_dict)

    async def broadcast(self, version: int, timeout_s: float) -> dict[str, Any]:
        if self.hang:
            await asyncio.Event().wait()
        await self.wire.put(self.state_dict)
        return {"version": version, "checksum": state_dict_checksum(self.state_dict), "bytes": 0}


def _fake_rpc(trainer: _FakeTrainer, workers: int, corrupt: bool = False):
    async def rpc(method: str, kwargs: dict[str, Any], timeout_s: float) -> list[Any]:
        if method == "rlsdk_nccl_init":
            return [{"ok": True}] * workers
        if method == "rlsdk_weight_info":
            return [{"checksum": None}] * workers
        assert method == "rlsdk_nccl_receive"
        received = dict(await trainer.wire.get())
        assert [e["name"] for e in kwargs["layout"]] == sorted(received)
        if corrupt:
            received["lm_head.weight"] = received["lm_head.weight"] + 1
        return [{"checksum": state_dict_checksum(received), "path": "nccl"} for _ in range(workers)]

    return rpc


def test_tensor_layout_lists_names_sorted_with_dtype_names_and_shapes() -> None:
    state_dict = _state_dict()

    layout = tensor_layout(state_dict)

    assert layout == [
        {"name": "lm_head.weight", "dtype": "float32", "shape": [8, 4]},
        {"name": "model.embed.weight", "dtype": "bfloat16", "shape": [8, 4]},
    ]
    assert layout_bytes(layout) == 8 * 4 * 4 + 8 * 4 * 2


def test_nccl_push_with_matching_checksums_joins_once_and_returns_the_workers_result() -> None:
    trainer = _FakeTrainer(_state_dict())
    transfer = NcclWeightTransfer(trainer, NcclRendezvous("127.0.0.1", 29600, world_size=3))

    async def scenario() -> list[dict[str, Any]]:
        rpc = _fake_rpc(trainer, workers=2)
        return [await transfer.push(rpc, "ignored", version, timeout_s=5.0) for version in (1, 2)]

    first, second = asyncio.run(scenario())

    assert trainer.joined == 1
    assert first["checksum"] == state_dict_checksum(trainer.state_dict) == second["checksum"]
    assert transfer.server_args() == (
        "--worker-extension-cls",
        "rlsdk.engine.inference.nccl_sync.NcclWeightSyncExtension",
    )


def test_nccl_push_when_a_worker_loaded_other_bytes_raises_weight_mismatch() -> None:
    trainer = _FakeTrainer(_state_dict())
    transfer = NcclWeightTransfer(trainer, NcclRendezvous("127.0.0.1", 29600, world_size=2))

    with pytest.raises(WeightMismatchError, match="v1: trainer sent checksum"):
        asyncio.run(transfer.push(_fake_rpc(trainer, workers=1, corrupt=True), "ignored", 1, timeout_s=5.0))


def test_nccl_push_when_the_trainer_never_sends_raises_timeout_instead_of_hanging() -> None:
    trainer = _FakeTrainer(_state_dict(), hang=True)
    transfer = NcclWeightTransfer(trainer, NcclRendezvous("127.0.0.1", 29600, world_size=2))

    with pytest.raises(WeightSyncTimeoutError, match=r"v1 did not finish within 0\.3 s"):
        asyncio.run(transfer.push(_fake_rpc(trainer, workers=1), "ignored", 1, timeout_s=0.3))


def test_call_with_timeout_on_a_blocked_call_aborts_and_raises_naming_the_step() -> None:
    release = threading.Event()
    aborted: list[bool] = []

    def abort() -> None:
        aborted.append(True)
        release.set()

    with pytest.raises(WeightSyncTimeoutError, match=r"NCCL broadcast .* within 0\.2 s"):
        call_with_timeout(release.wait, 0.2, "NCCL broadcast (test)", on_timeout=abort)

    assert aborted == [True]


def test_rendezvous_without_a_worker_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one vLLM worker"):
        NcclRendezvous("127.0.0.1", 29600, world_size=1)


def _needs_two_gpus_and_vllm() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("gpu: needs 2 CUDA devices (NCCL refuses two ranks on one device)")
    pytest.importorskip("vllm.distributed.device_communicators.pynccl", reason="gpu: needs a CUDA build of vLLM")


def _receiver(port: int, shapes: list[dict[str, Any]], queue: Any) -> None:
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

    torch.cuda.set_device(1)
    comm = stateless_init_process_group("127.0.0.1", port, 1, 2, device=1)
    tensors = {e["name"]: torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]), device="cuda:1") for e in shapes}
    for entry in shapes:
        comm.broadcast(tensors[entry["name"]], src=0, stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    queue.put(state_dict_checksum(tensors))


@pytest.mark.gpu
def test_nccl_sender_broadcast_to_a_second_gpu_arrives_bit_identical() -> None:
    _needs_two_gpus_and_vllm()
    import torch.multiprocessing as mp

    from rlsdk.engine.inference.nccl_sync import NcclWeightSender
    from rlsdk.procutil import free_port

    torch.cuda.set_device(0)
    state_dict = {name: tensor.to("cuda:0") for name, tensor in _state_dict().items()}
    port = free_port("127.0.0.1")
    context = mp.get_context("spawn")
    queue = context.Queue()
    peer = context.Process(target=_receiver, args=(port, tensor_layout(state_dict), queue))
    peer.start()
    sender = NcclWeightSender()
    sender.join(NcclRendezvous("127.0.0.1", port, world_size=2), timeout_s=60.0)

    sent = sender.broadcast(state_dict, timeout_s=60.0)

    assert queue.get(timeout=60.0) == sent["checksum"]
    peer.join(timeout=30.0)


@pytest.mark.gpu
def test_nccl_sender_whose_peer_never_receives_raises_timeout_instead_of_hanging() -> None:
    _needs_two_gpus_and_vllm()
    import torch.multiprocessing as mp

    from rlsdk.engine.inference.nccl_sync import NcclWeightSender
    from rlsdk.procutil import free_port

    torch.cuda.set_device(0)
    big = {"w": torch.zeros(64 * 1024 * 1024, device="cuda:0")}
    port = free_port("127.0.0.1")
    context = mp.get_context("spawn")
    peer = context.Process(target=_join_then_exit, args=(port,))
    peer.start()
    sender = NcclWeightSender()
    sender.join(NcclRendezvous("127.0.0.1", port, world_size=2), timeout_s=60.0)

    with pytest.raises(WeightSyncTimeoutError, match="NCCL broadcast"):
        sender.broadcast(big, timeout_s=5.0)

    peer.join(timeout=30.0)


def _join_then_exit(port: int) -> None:
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

    torch.cuda.set_device(1)
    stateless_init_process_group("127.0.0.1", port, 1, 2, device=1)
