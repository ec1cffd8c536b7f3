"""Distributed behaviour on real gloo ranks and on torch's fake process group; suites this machine cannot run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from rlsdk.testing import assert_close


def _sum_of_ranks(rank: int, world_size: int) -> float:
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return float(value.item())


def test_all_reduce_sum_two_gloo_ranks_every_rank_gets_total(gloo_group: Any) -> None:
    results = gloo_group(_sum_of_ranks, 2)

    assert results == [1.0, 1.0]


def test_broadcast_on_fake_pg_keeps_shape(fake_pg: Any) -> None:
    weights_N = torch.arange(4.0)

    dist.broadcast(weights_N, src=0, group=fake_pg)

    assert_close(weights_N, torch.arange(4.0), rtol=0.0, atol=0.0)


@pytest.mark.gpu
def test_all_reduce_on_nccl_matches_gloo() -> None:
    assert torch.cuda.device_count() >= 1


@pytest.mark.vllm
def test_reward_on_vllm_samples() -> None:
    vllm = pytest.importorskip("vllm", reason="vllm: the vllm extra is not installed")
    assert vllm.__version__
