"""Rank-side fault injection for tests of failure handling (users' own, and rlsdk's fault suite).

Each function is a ``call_function`` target: ``await session.call("call_function", {"target":
"rlsdk.testing.faults:raise_on_rank", "kwargs": {"rank": 1}})`` runs it on every rank of a live Session.
"""

from __future__ import annotations

from typing import Any


class InjectedFault(RuntimeError):
    """The error a fault-injection target raises on purpose."""


def raise_on_rank(worker: Any, rank: int, message: str = "injected fault") -> dict[str, int]:
    """Rank ``rank`` raises :class:`InjectedFault`; every other rank enters an all-reduce that rank never joins
    (as when one rank fails half-way through an update): the others wait there until the process group times
    out or the Session stops them."""
    import torch
    import torch.distributed as dist

    if worker.rank == rank:
        raise InjectedFault(f"{message} (rank {rank})")
    tensor = torch.ones(4)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return {"rank": worker.rank}


def raise_on_every_rank(worker: Any, message: str = "injected fault") -> None:
    """Every rank raises :class:`InjectedFault` before any collective: the ranks stay in step."""
    raise InjectedFault(f"{message} (rank {worker.rank})")
