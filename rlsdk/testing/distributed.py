"""Run a function on N real gloo ranks (separate processes) for integration tests.

``run_gloo_ranks(fn, world_size, *args)`` starts ``world_size`` spawned processes with the usual torchrun
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` on loopback) and calls
``fn(rank, world_size, *args)`` in each; ``fn`` must be importable (module level). Each rank's return value is
sent back; an exception in any rank is re-raised in the caller with the rank and its traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback
from collections.abc import Callable
from typing import Any

from rlsdk.config.device import GLOO
from rlsdk.procutil import free_port


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, queue: Any) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    import torch

    torch.set_num_threads(1)
    try:
        # plain pickle copies tensor data: torch's shared-memory handles die with this process
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_gloo_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; returns results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, queue)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout_s)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[r] for r in range(world_size)]


def _init_group_then_call(rank: int, world_size: int, fn: Callable[..., Any], backend: str, *args: Any) -> Any:
    import torch.distributed as dist

    dist.init_process_group(backend, rank=rank, world_size=world_size)  # env://, set by _entry
    return fn(rank, world_size, *args)


def run_in_process_group(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = GLOO, timeout_s: float = 120.0
) -> list[Any]:
    """``run_gloo_ranks`` with the default process group (``backend``) initialised on every rank first.

    ``fn(rank, world_size, *args)`` may call collectives on the default group at once; the group is destroyed
    when ``fn`` returns or raises. Returns the results by rank; a rank's exception is re-raised naming the rank.
    """
    return run_gloo_ranks(_init_group_then_call, world_size, fn, backend, *args, timeout_s=timeout_s)
