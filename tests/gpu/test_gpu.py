"""Tests that need a CUDA device (``pytest -m gpu``). On a machine without one the rlsdk plugin skips them with the
reason ``gpu: requires a CUDA device: torch.cuda.is_available() is False`` and the skipped-suite report names them.
None of them has run yet: this project's machines have no GPU (docs/howto/gpu.md says what has and has not run)."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rlsdk import Session, SessionConfig
from rlsdk.config.device import NCCL_TRACE_BUFFER_SIZE, accelerator_kwargs, process_group_backend
from rlsdk.debug.analyze import analyze
from rlsdk.rewards import reverse_reward

pytestmark = pytest.mark.gpu


def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"gpu: needs 2 CUDA devices, torch.cuda.device_count() is {torch.cuda.device_count()}")


def _cuda(config: SessionConfig, **launch: Any) -> SessionConfig:
    return dataclasses.replace(config, launch=dataclasses.replace(config.launch, device="cuda", **launch))


@pytest.mark.distributed
def test_session_on_cuda_with_one_rank_runs_a_verified_step(small_config: SessionConfig) -> None:
    config = _cuda(small_config, num_ranks=1)

    async def scenario() -> tuple[int, str, str]:
        async with await Session.start(config) as session:
            await session.update(await session.reward(await session.rollout(), reverse_reward))
            info = await session.sync_weights()  # verified: the engine's checksum equals the trainer's
            return info.version, session._run.device_plan.device, session._run.device_plan.process_group_backend

    version, device, backend = asyncio.run(scenario())

    assert (version, device, backend) == (1, "cuda", process_group_backend("cuda"))


@pytest.mark.distributed
@pytest.mark.vllm
def test_session_on_cuda_syncs_weights_to_vllm_over_nccl_verified_by_checksum(small_config: SessionConfig) -> None:
    _two_gpus()  # the rank on GPU 0, vLLM on GPU 1: NCCL refuses two ranks of one communicator on one GPU
    # gpus_per_node > 0: inference.vllm.weight_transfer 'auto' picks the NCCL broadcast from trainer rank 0.
    config = _cuda(small_config, num_ranks=1, gpus_per_node=2)
    config = dataclasses.replace(config, inference=dataclasses.replace(config.inference, engine="vllm"))

    async def scenario() -> list[Any]:
        async with await Session.start(config) as session:
            infos = []
            for _ in range(2):
                await session.update(await session.reward(await session.rollout(), reverse_reward))
                infos.append(await session.sync_weights())
            return infos

    infos = asyncio.run(scenario())

    assert [info.version for info in infos] == [1, 2]
    assert all(info.checksum for info in infos) and infos[0].checksum != infos[1].checksum


def _mismatched_rank(rank: int, port: int, out: Any) -> None:
    """Rank 0 all-reduces, rank 1 broadcasts: a desync at collective 1. Both are posted asynchronously (the GPU
    waits, the host does not); the Flight Recorder dump is read while they hang, then the process exits hard."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = str(NCCL_TRACE_BUFFER_SIZE)
    torch.cuda.set_device(rank)
    dist.init_process_group(process_group_backend("cuda"), rank=rank, world_size=2)
    tensor = torch.ones(4, device="cuda")
    dist.all_reduce(tensor)  # collective 0: matched
    torch.cuda.synchronize()
    if rank == 0:
        dist.all_reduce(tensor, async_op=True)
    else:
        dist.broadcast(tensor, src=0, async_op=True)
    time.sleep(3.0)
    from rlsdk.debug.flight_recorder import FlightRecorderView

    # what a rank answers the controller's trace query with on CUDA (rlsdk.debug.rank)
    out.put((rank, FlightRecorderView("cuda").snapshot()))
    out.close()
    out.join_thread()
    os._exit(0)  # the hung NCCL kernels would block a clean shutdown


def test_nccl_flight_recorder_shows_a_desync_at_the_same_sequence_number() -> None:
    _two_gpus()
    from rlsdk.procutil import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_mismatched_rank, args=(rank, port, out)) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        traces = dict(out.get(timeout=120) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()

    last = {rank: state["records"][-1] for rank, state in traces.items()}
    assert last[0]["seq"] == last[1]["seq"]  # the same collective sequence number ...
    assert (last[0]["op"], last[1]["op"]) == ("allreduce", "broadcast")  # ... different collectives
    report = analyze(traces, site_check=lambda site: False)  # the analyser, report and notebook view of CPU ranks
    assert report.divergence is not None and report.divergence.kind == "op mismatch"
    assert report.divergence.seq == last[0]["seq"] and report.divergence.settled
    # the call site is this file's async collective, found in the Flight Recorder's frames
    assert all("test_gpu.py:" in side["record"]["site"] for side in report.divergence.sides)


def test_update_on_cuda_makes_no_host_sync_before_its_metrics(tiny_model_dir: Path) -> None:
    import sys

    from accelerate import Accelerator

    from rlsdk.config import ModelConfig, TrainConfig
    from rlsdk.engine.train.engine import TrainEngine

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from test_ddp_gradients import _make_batch

    model_dir = str(tiny_model_dir)
    config = SessionConfig(model=ModelConfig(path=model_dir), train=TrainConfig(micro_batch_size=4))
    engine = TrainEngine(config, Accelerator(**accelerator_kwargs("cuda")))
    # as TrainEngine.update does with what the controller sends: the prompt groups found on the CPU copy, then the
    # shard on the device (the groups stay on the host)
    batch = engine.on_device(engine.with_prompt_groups(_make_batch(model_dir, group_size=3)))
    tokens = int(batch["completion_mask_B_C"].sum())
    engine.update(batch, tokens, num_sequences_global=12)  # warm-up: allocations and kernels' first launch

    torch.cuda.set_sync_debug_mode("error")
    try:
        # Everything up to the metrics: the micro-batches' losses, log-probs, backward and the optimizer step.
        for _ in range(2):
            engine.accumulate_gradients(batch, tokens, num_sequences_global=12)
            engine._optimizer_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _open_and_checksum(handle: dict[str, Any], layout: list[dict[str, Any]], out: Any) -> None:
    """The vLLM worker's half of the shared-card sync in another process on the same GPU: map, view, checksum."""
    from rlsdk.engine.inference.ipc_sync import open_storage, unpack
    from rlsdk.engine.weights import state_dict_checksum

    torch.cuda.set_device(0)
    tensors = unpack(open_storage(handle, 0), layout)
    out.put(state_dict_checksum(tensors))


def test_cuda_ipc_handle_maps_rank_zeros_packed_weights_bit_identically_in_another_process() -> None:
    from rlsdk.engine.inference.ipc_sync import export_storage, pack_state_dict
    from rlsdk.engine.weights import state_dict_checksum

    generator = torch.Generator().manual_seed(0)
    state_dict = {
        "embed.weight": torch.randn(1000, 64, generator=generator).to("cuda", torch.bfloat16),
        "norm.weight": torch.ones(64, device="cuda"),
    }
    state_dict["lm_head.weight"] = state_dict["embed.weight"]  # tied
    buffer, layout = pack_state_dict(state_dict)
    handle = export_storage(buffer)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_open_and_checksum, args=(handle, layout, out))

    proc.start()
    try:
        received = out.get(timeout=120)
    finally:
        proc.join(timeout=30)

    assert proc.exitcode == 0
    assert received == state_dict_checksum(state_dict)
