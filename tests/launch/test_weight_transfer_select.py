"""The weight transfer the topology selects, and the GPU path's wiring on CPU: the Session's engine construction,
the rank command ``broadcast_weights_nccl`` and the verification, with every CUDA part replaced by a fake."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import torch

from rlsdk import Session, SessionConfig
from rlsdk.config import InferenceConfig, LaunchConfig, ModelConfig, VLLMConfig
from rlsdk.engine.inference import nccl_sync
from rlsdk.engine.inference.protocol import WeightInfo
from rlsdk.engine.inference.weight_transfer import (
    NCCL_WORKER_EXTENSION,
    FileWeightTransfer,
    NcclRendezvous,
    NcclWeightTransfer,
    RankCommandTrainer,
    select_weight_transfer,
    weight_transfer_class,
)
from rlsdk.engine.weights import state_dict_checksum
from rlsdk.versioning import WeightMismatchError
from rlsdk.worker.main import Worker

GPU_LAUNCH = LaunchConfig(
    scheduler="slurm", num_nodes=2, num_ranks=16, gpus_per_node=8, host="10.0.0.5", allow_remote=True
)


def _unused_trainer() -> RankCommandTrainer:
    async def call(body: dict[str, Any], timeout_s: float) -> list[Any]:
        raise AssertionError("selection must not talk to the ranks")

    return RankCommandTrainer(call)


def test_select_weight_transfer_for_a_gpu_topology_picks_the_nccl_broadcast() -> None:
    transfer = select_weight_transfer(GPU_LAUNCH, _unused_trainer())

    assert isinstance(transfer, NcclWeightTransfer)
    assert tuple(transfer.server_args()) == ("--worker-extension-cls", NCCL_WORKER_EXTENSION)


def test_select_weight_transfer_without_gpus_picks_the_shared_memory_file() -> None:
    transfer = select_weight_transfer(LaunchConfig(), _unused_trainer())

    assert isinstance(transfer, FileWeightTransfer)
    assert weight_transfer_class(LaunchConfig()).SERVER_ARGS == ()


def test_select_weight_transfer_explicit_choice_overrides_the_topology() -> None:
    from rlsdk.engine.inference.inplace_transfer import PLAIN_WORKER_EXTENSION, InPlaceWeightTransfer

    inplace = select_weight_transfer(LaunchConfig(), _unused_trainer(), "inplace")
    reload = select_weight_transfer(GPU_LAUNCH, _unused_trainer(), "reload")

    assert isinstance(inplace, InPlaceWeightTransfer)
    assert tuple(inplace.server_args()) == ("--worker-extension-cls", PLAIN_WORKER_EXTENSION)
    assert type(reload) is FileWeightTransfer


def test_inplace_weight_transfer_on_gpu_nodes_raises_config_error_naming_both_fields() -> None:
    from rlsdk.config import ConfigError

    with pytest.raises(ConfigError, match=r"inference\.vllm\.weight_transfer.*launch\.gpus_per_node = 8 > 0"):
        SessionConfig(
            model=ModelConfig(path="unused"),
            launch=GPU_LAUNCH,
            inference=InferenceConfig(engine="vllm", vllm=VLLMConfig(weight_transfer="inplace")),
        )


@pytest.mark.parametrize(
    ("gpus_per_node", "choice", "expected"),
    [(8, "auto", NcclWeightTransfer), (0, "auto", FileWeightTransfer), (0, "inplace", None), (8, "reload", None)],
)
def test_session_build_engine_gives_the_vllm_engine_the_transfer_of_the_topology(
    small_config: SessionConfig, monkeypatch: pytest.MonkeyPatch, gpus_per_node: int, choice: str, expected: Any
) -> None:
    from rlsdk.engine.inference.inplace_transfer import InPlaceWeightTransfer

    expected = expected or {"inplace": InPlaceWeightTransfer, "reload": FileWeightTransfer}[choice]
    from rlsdk.engine.inference.vllm import VLLMEngine

    seen: dict[str, Any] = {}

    async def attach(cls: Any, url: str, model_path: str, **kwargs: Any) -> str:
        seen.update(url=url, transfer=kwargs["transfer"])
        return "engine"

    monkeypatch.setattr(VLLMEngine, "attach", classmethod(attach))
    config = dataclasses.replace(
        small_config,
        launch=dataclasses.replace(small_config.launch, gpus_per_node=gpus_per_node),
        inference=InferenceConfig(
            engine="vllm",
            vllm=VLLMConfig(url="http://10.0.0.9:8000", weight_transfer=choice),  # type: ignore[arg-type]
        ),
    )

    engine = asyncio.run(Session(config)._build_engine())

    assert engine == "engine"
    assert seen["url"] == "http://10.0.0.9:8000"
    assert type(seen["transfer"]) is expected


def test_session_build_engine_with_a_slurm_vllm_replica_attaches_to_the_endpoint_the_job_reported(
    small_config: SessionConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlsdk.engine.inference.vllm import VLLMEngine

    seen: dict[str, Any] = {}

    async def attach(cls: Any, url: str, model_path: str, **kwargs: Any) -> str:
        seen["url"] = url
        seen["token"] = kwargs.get("token")
        return "engine"

    class FakeSlurmLauncher:
        vllm_replicas = 1
        vllm_token = "the-jobs-replica-token"

        async def wait_for_endpoint(self, replica: int, *, timeout_s: float) -> str:
            seen["replica"] = replica
            return "http://node-3:41234"

    monkeypatch.setattr(VLLMEngine, "attach", classmethod(attach))
    session = Session(dataclasses.replace(small_config, inference=InferenceConfig(engine="vllm")))
    session._run.launcher = FakeSlurmLauncher()

    asyncio.run(session._build_engine())

    assert seen == {"replica": 0, "url": "http://node-3:41234", "token": "the-jobs-replica-token"}


class _FakeTrainEngine:
    def __init__(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.state_dict = state_dict
        self.version = version

    def full_state_dict(self, *, keep: bool) -> dict[str, torch.Tensor] | None:
        return dict(self.state_dict) if keep else None


class _FakeSender:
    """NcclWeightSender without CUDA: 'broadcasts' by putting the tensors on an in-process wire."""

    wire: asyncio.Queue[dict[str, torch.Tensor]]
    joined: list[NcclRendezvous]

    def join(self, rendezvous: NcclRendezvous, timeout_s: float) -> None:
        self.joined.append(rendezvous)

    def broadcast(self, state_dict: dict[str, torch.Tensor], timeout_s: float) -> dict[str, Any]:
        self.wire.put_nowait(state_dict)
        return {"checksum": state_dict_checksum(state_dict), "bytes": 1}

    def abort(self) -> None:
        pass


def _gpu_path_on_cpu(
    monkeypatch: pytest.MonkeyPatch, *, trainer_version: int, corrupt: bool = False
) -> tuple[NcclWeightTransfer, Any, list[Worker], list[NcclRendezvous]]:
    """Two train ranks (real Worker command handlers, fake train engines), rank 0's NCCL sender and the CUDA copy
    replaced by fakes, one vLLM worker answering the collective RPCs from the wire."""
    wire: asyncio.Queue[dict[str, torch.Tensor]] = asyncio.Queue()
    joined: list[NcclRendezvous] = []
    monkeypatch.setattr(_FakeSender, "wire", wire, raising=False)
    monkeypatch.setattr(_FakeSender, "joined", joined, raising=False)
    monkeypatch.setattr(nccl_sync, "NcclWeightSender", _FakeSender)
    monkeypatch.setattr(nccl_sync, "cuda_state_dict", dict)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    state_dict = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
    workers = [Worker(None, rank, 2) for rank in range(2)]
    for worker in workers:
        worker.engine = _FakeTrainEngine(state_dict, trainer_version)

    async def call(body: dict[str, Any], timeout_s: float) -> list[Any]:
        return [worker.handlers["broadcast_weights_nccl"](dict(body)) for worker in workers]

    async def rpc(method: str, kwargs: dict[str, Any], timeout_s: float) -> list[Any]:
        if method == "rlsdk_weight_info":
            return [{"checksum": None}]
        if method == "rlsdk_nccl_init":
            return [{"ok": True}]
        assert method == "rlsdk_nccl_receive"
        received = dict(await wire.get())
        assert [entry["name"] for entry in kwargs["layout"]] == sorted(received)
        if corrupt:
            received["w"] = received["w"] + 1
        return [{"checksum": state_dict_checksum(received), "path": f"nccl:v{kwargs['version']}"}]

    return NcclWeightTransfer(RankCommandTrainer(call)), rpc, workers, joined


def test_nccl_sync_through_the_rank_command_forms_the_group_at_rank_zero_and_verifies_version_and_checksum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transfer, rpc, workers, joined = _gpu_path_on_cpu(monkeypatch, trainer_version=1)

    loaded = asyncio.run(transfer.push(rpc, "", 1, timeout_s=5.0))

    expected = state_dict_checksum(workers[0].engine.state_dict)
    assert loaded["checksum"] == expected
    assert transfer.last_sent == {"version": 1, "checksum": expected, "bytes": 1}
    assert len(joined) == 1 and joined[0].master_address == "10.0.0.7" and joined[0].world_size == 2
    assert workers[1].nccl.sender is None  # only trainer rank 0 joins the NCCL group


def test_nccl_sync_when_a_vllm_worker_loaded_other_bytes_raises_weight_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transfer, rpc, _, _ = _gpu_path_on_cpu(monkeypatch, trainer_version=1, corrupt=True)

    with pytest.raises(WeightMismatchError, match="trainer sent checksum"):
        asyncio.run(transfer.push(rpc, "", 1, timeout_s=5.0))


def test_nccl_sync_when_the_trainer_holds_another_version_raises_weight_mismatch_naming_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transfer, rpc, _, _ = _gpu_path_on_cpu(monkeypatch, trainer_version=2)

    with pytest.raises(WeightMismatchError, match=r"sync of v1: trainer rank 0 sent v2"):
        asyncio.run(transfer.push(rpc, "", 1, timeout_s=5.0))


def test_rank_command_send_before_join_and_layout_raises_naming_the_order() -> None:
    worker = Worker(None, 0, 1)
    worker.engine = _FakeTrainEngine({"w": torch.zeros(1)}, 0)

    with pytest.raises(RuntimeError, match="'send' before 'join' and 'layout'"):
        worker.broadcast_weights_nccl({"step": "send", "timeout_s": 1.0})
    with pytest.raises(ValueError, match="unknown step 'bogus'"):
        worker.broadcast_weights_nccl({"step": "bogus"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal; this machine has CUDA")
def test_cuda_state_dict_on_a_machine_without_cuda_raises_naming_gpus_per_node() -> None:
    with pytest.raises(RuntimeError, match="gpus_per_node=0"):
        nccl_sync.cuda_state_dict({"w": torch.zeros(1)})


class _SentTransfer:
    """The NCCL transfer as the engine's sync sees it: it already verified the workers; ``last_sent`` is rank 0's."""

    name = "nccl"

    def __init__(self, sent: dict[str, Any]) -> None:
        self.last_sent = sent

    def server_args(self) -> list[str]:
        return []


def _nccl_engine(sent: dict[str, Any], serves: WeightInfo) -> tuple[Any, list[tuple[str, int]]]:
    """A real VLLMEngine on the NCCL path whose server answers a load with ``serves`` (no server is reached)."""
    from rlsdk.engine.inference.vllm import VLLMEngine

    engine = VLLMEngine("http://127.0.0.1:9", pad_token_id=0, transfer=_SentTransfer(sent))  # type: ignore[arg-type]
    loaded: list[tuple[str, int]] = []

    async def load_weights(path: str, version: int) -> WeightInfo:
        loaded.append((path, version))
        return serves

    engine.load_weights = load_weights  # type: ignore[method-assign]
    return engine, loaded


def test_session_sync_weights_on_the_nccl_path_sends_no_file_and_records_the_verified_sync(
    small_config: SessionConfig,
) -> None:
    session = Session(small_config)
    session.versions.trainer_version = 1
    session.engine, loaded = _nccl_engine({"version": 1, "checksum": "c1" * 32}, WeightInfo(1, "c1" * 32))

    info = asyncio.run(session.sync_weights())

    assert info == WeightInfo(1, "c1" * 32)
    assert loaded == [("", 1)]
    assert (session.versions.engine_version, session.versions.trainer_checksum) == (1, "c1" * 32)


def test_session_sync_weights_on_the_nccl_path_when_the_engine_serves_other_weights_raises_mismatch(
    small_config: SessionConfig,
) -> None:
    session = Session(small_config)
    session.versions.trainer_version = 1
    session.engine, _ = _nccl_engine({"version": 1, "checksum": "c1" * 32}, WeightInfo(1, "ff" * 32))

    with pytest.raises(WeightMismatchError, match="engine serves v1"):
        asyncio.run(session.sync_weights())
