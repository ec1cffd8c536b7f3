"""Shared-memory all-reduce: threads stand in for ranks (one anonymous mapping, one reducer per "rank"); the
real process-group path (DDP's buckets through the traced backend, on gloo ranks) is in the distributed test."""

from __future__ import annotations

import mmap
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from rlsdk.engine.train.shm_allreduce import SharedMemoryAllreduce
from rlsdk.testing.distributed import run_gloo_ranks

HEADER_PER_RANK = 128


def _reducers(size: int, *, slot_bytes: int = 4096, timeout_s: float = 30.0) -> list[SharedMemoryAllreduce]:
    buffer = mmap.mmap(-1, size * HEADER_PER_RANK + 2 * size * slot_bytes)
    return [SharedMemoryAllreduce(buffer, r, size, slot_bytes=slot_bytes, timeout_s=timeout_s) for r in range(size)]


def _on_ranks(size: int, fn: Callable[[int], Any], **kwargs: Any) -> list[Any]:
    """Run ``fn(rank)`` on ``size`` threads at once; re-raise the first failure."""
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return results


def _reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    out = inputs[0].clone()
    for other in inputs[1:]:
        if op in ("SUM", "AVG"):
            out.add_(other)
        elif op == "PRODUCT":
            out.mul_(other)
        elif op == "MIN":
            out = torch.minimum(out, other)
        else:
            out = torch.maximum(out, other)
    if op == "AVG":
        out = out / len(inputs) if out.is_floating_point() else out.floor_divide(len(inputs))
    return out


@pytest.mark.parametrize("op", ["SUM", "AVG", "PRODUCT", "MIN", "MAX"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_allreduce_with_three_ranks_gives_every_rank_the_rank_order_reduction_bit_for_bit(
    op: str, dtype: torch.dtype
) -> None:
    # Arrange
    reducers = _reducers(3)
    inputs = [(torch.randn(1000, generator=torch.Generator().manual_seed(r)) * 10).to(dtype) for r in range(3)]
    tensors = [t.clone() for t in inputs]

    # Act
    _on_ranks(3, lambda r: reducers[r].allreduce(tensors[r], op))

    # Assert
    expected = _reference(inputs, op)
    for tensor in tensors:
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0)


def test_allreduce_of_tensors_larger_than_a_slot_goes_in_chunks_and_calls_in_a_row_stay_in_step() -> None:
    # Arrange: 64-byte slots, so a 1000-float tensor takes 63 chunks; several calls of other sizes follow
    reducers = _reducers(2, slot_bytes=64)
    sizes = [1000, 1, 0, 17, 333]
    inputs = {
        (r, n): torch.randn(n, generator=torch.Generator().manual_seed(10 * r + n)) for r in range(2) for n in sizes
    }

    # Act
    def run(rank: int) -> list[torch.Tensor]:
        out = []
        for n in sizes:
            tensor = inputs[rank, n].clone()
            reducers[rank].allreduce(tensor, "SUM")
            out.append(tensor)
        return out

    results = _on_ranks(2, run)

    # Assert
    for i, n in enumerate(sizes):
        expected = inputs[0, n] + inputs[1, n]
        for rank in range(2):
            torch.testing.assert_close(results[rank][i], expected, rtol=0, atol=0)
    assert reducers[0].calls == len(sizes)


def test_allreduce_of_a_non_contiguous_tensor_updates_it_in_place() -> None:
    # Arrange
    reducers = _reducers(2)
    bases = [torch.arange(12, dtype=torch.float32).reshape(3, 4) * (r + 1) for r in range(2)]
    views = [base.t() for base in bases]

    # Act
    _on_ranks(2, lambda r: reducers[r].allreduce(views[r], "MAX"))

    # Assert
    expected = torch.arange(12, dtype=torch.float32).reshape(3, 4) * 2
    for base in bases:
        torch.testing.assert_close(base, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("tensors", "op"),
    [
        ([torch.ones(2)], "BAND"),
        ([torch.ones(2)], None),
        ([torch.ones(2, dtype=torch.bool)], "SUM"),
        ([torch.ones(2, dtype=torch.complex64)], "SUM"),
        ([torch.ones(2), torch.ones(2)], "SUM"),
        ([torch.ones(2).to_sparse()], "SUM"),
    ],
)
def test_supports_refuses_ops_dtypes_layouts_and_tensor_lists_gloo_should_take(tensors: list, op: str | None) -> None:
    # Act / Assert
    assert not SharedMemoryAllreduce.supports(tensors, op)


def test_allreduce_of_an_unsupported_dtype_raises_naming_the_dtype_and_op() -> None:
    # Arrange
    reducer = _reducers(2)[0]

    # Act / Assert
    with pytest.raises(ValueError, match=r"torch.bool cpu tensor with op SUM is not supported"):
        reducer.allreduce(torch.ones(2, dtype=torch.bool), "SUM")


def test_allreduce_when_a_rank_never_arrives_raises_after_the_timeout_naming_the_rank() -> None:
    # Arrange
    reducer = _reducers(2, timeout_s=0.3)[0]

    # Act / Assert
    with pytest.raises(RuntimeError, match=r"timed out after .* ranks \[1\] never arrived"):
        reducer.allreduce(torch.ones(4), "SUM")


def test_allreduce_when_a_peer_process_has_exited_raises_naming_its_rank_and_pid() -> None:
    # Arrange: rank 1's pid slot holds a process that has exited
    reducers = _reducers(2)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    reducers[1]._counters[1 * 16 + 8] = pid

    # Act / Assert
    with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {pid}\) has exited"):
        reducers[0].allreduce(torch.ones(4), "SUM")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0, "size": 1}, "allowed size >= 2"),
        ({"rank": 2, "size": 2}, "0 <= rank < size"),
        ({"rank": 0, "size": 2, "slot_bytes": 12}, "slot_bytes=12 is invalid"),
        ({"rank": 0, "size": 2, "slot_bytes": 1 << 20}, "too small"),
    ],
)
def test_constructor_with_bad_arguments_raises_naming_the_argument(kwargs: dict, message: str) -> None:
    # Arrange
    buffer = mmap.mmap(-1, 2 * HEADER_PER_RANK + 4 * 4096)
    kwargs = {"slot_bytes": 4096, **kwargs}

    # Act / Assert
    with pytest.raises(ValueError, match=message):
        SharedMemoryAllreduce(buffer, timeout_s=1.0, **kwargs)


def test_create_on_one_host_maps_one_segment_and_leaves_no_file_behind(tmp_path: Any) -> None:
    # Arrange
    import torch.distributed as dist

    store = dist.HashStore()
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()

    # Act
    reducers = _on_ranks(2, lambda r: SharedMemoryAllreduce.create(store, r, 2, timedelta(seconds=30)))
    tensors = [torch.full((3,), float(r + 1)) for r in range(2)]
    _on_ranks(2, lambda r: reducers[r].allreduce(tensors[r], "SUM"))

    # Assert
    assert all(isinstance(r, SharedMemoryAllreduce) for r in reducers)
    torch.testing.assert_close(tensors[1], torch.full((3,), 3.0), rtol=0, atol=0)
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {name for name in after - before if name.startswith("rlsdk-allreduce-")}


def test_create_with_one_rank_or_ranks_on_two_hosts_returns_none() -> None:
    # Arrange
    import torch.distributed as dist

    store = dist.HashStore()
    store.set("rlsdk_shm_allreduce/host/1", "x86_64|another-host/boot")

    # Act / Assert
    assert SharedMemoryAllreduce.create(dist.HashStore(), 0, 1, timedelta(seconds=5)) is None
    assert SharedMemoryAllreduce.create(store, 0, 2, timedelta(seconds=5)) is None
    assert store.get("rlsdk_shm_allreduce/path") == b""


def _ddp_steps(rank: int, world: int, shm: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from rlsdk.debug import tracer

    tracer.init_traced_process_group(shm_allreduce=shm)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    counts = torch.tensor([rank + 1, 10], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    flags = torch.tensor([rank == 0])
    dist.all_reduce(flags)  # bool: gloo's path
    group = dist.distributed_c10d._get_default_group()
    shm_calls = group._shm.calls if getattr(group, "_shm", None) is not None else 0
    ops = [(r["op"], r["shapes"]) for r in tracer.snapshot()["records"]]
    return {"weights": [p.detach().clone() for p in model.parameters()], "counts": counts, "flags": flags,
            "shm_calls": shm_calls, "ops": ops}  # fmt: skip


@pytest.mark.distributed
def test_ddp_on_two_gloo_ranks_through_shared_memory_matches_gloo_and_keeps_the_trace() -> None:
    # Act
    shm = run_gloo_ranks(_ddp_steps, 2, True)
    gloo = run_gloo_ranks(_ddp_steps, 2, False)

    # Assert: same weights bit for bit (a + b either way), shared memory took DDP's buckets and the int64 MAX
    for rank in range(2):
        for a, b in zip(shm[rank]["weights"], gloo[rank]["weights"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert shm[rank]["counts"].tolist() == [2, 10] and shm[rank]["flags"].tolist() == [True]
        assert shm[rank]["shm_calls"] == 4 and gloo[rank]["shm_calls"] == 0
        assert shm[rank]["ops"] == gloo[rank]["ops"]
        assert ("allreduce", ((2,),)) in shm[rank]["ops"]


@pytest.mark.parametrize(
    ("tensors", "ops", "message"),
    [
        ([torch.ones(4), torch.ones(5)], ["SUM", "SUM"], r"0: '16 bytes of torch.float32, SUM', 1: '20 bytes"),
        ([torch.ones(4), torch.ones(4, dtype=torch.float64)], ["SUM", "SUM"], r"torch.float64"),
        ([torch.ones(4), torch.ones(4)], ["SUM", "MAX"], r"1: '16 bytes of torch.float32, MAX'"),
    ],
)
def test_allreduce_when_ranks_pass_different_sizes_dtypes_or_ops_raises_on_every_rank(
    tensors: list[torch.Tensor], ops: list[str], message: str
) -> None:
    # Arrange
    reducers = _reducers(2, slot_bytes=8)
    errors: list[str] = []

    def run(rank: int) -> None:
        try:
            reducers[rank].allreduce(tensors[rank], ops[rank])
        except RuntimeError as exc:
            errors.append(str(exc))

    # Act
    _on_ranks(2, run)

    # Assert
    assert len(errors) == 2 and all("passed different tensors or ops" in e for e in errors)
    assert all(re.search(message, e) for e in errors)
