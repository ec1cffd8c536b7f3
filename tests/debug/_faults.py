"""Fault scenarios run on real traced gloo ranks (module level: spawned ranks import them by name)."""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.distributed as dist


def _warmup() -> None:
    dist.all_reduce(torch.ones(4))  # seq 1: every rank agrees


def skipped_all_reduce(rank: int, world: int) -> None:
    _warmup()
    micro_batches = 1 if rank == world - 1 else 2  # data-dependent: the last rank got a shorter shard
    for _ in range(micro_batches):
        dist.all_reduce(torch.ones(8))  # SKIPPED_SITE


def extra_under_rank0(rank: int, world: int) -> None:
    _warmup()
    t = torch.ones(4)
    if rank == 0:
        dist.broadcast(t, src=0)  # EXTRA_SITE
    dist.all_reduce(t)  # COMMON_SITE


def all_reduce_vs_broadcast(rank: int, world: int) -> None:
    _warmup()
    op = dist.all_reduce if rank == 0 else functools.partial(dist.broadcast, src=0)
    op(torch.ones(4))  # OP_SITE


def shape_mismatch(rank: int, world: int) -> None:
    _warmup()
    dist.all_reduce(torch.ones(4 + rank))  # SHAPE_SITE


def gather_uneven(rank: int, world: int) -> None:
    _warmup()
    mine = torch.ones(2 + rank)
    out = [torch.empty(2 + rank) for _ in range(world)]
    dist.all_gather(out, mine)  # GATHER_SITE


def dtype_mismatch(rank: int, world: int) -> None:
    _warmup()
    dist.all_reduce(torch.ones(4, dtype=torch.float64 if rank == 0 else torch.float32))  # DTYPE_SITE


def sum_vs_max(rank: int, world: int) -> None:
    _warmup()
    dist.all_reduce(torch.ones(4), op=dist.ReduceOp.MAX if rank == world - 1 else dist.ReduceOp.SUM)  # REDUCE_SITE
    dist.barrier()


def broadcast_sources(rank: int, world: int) -> None:
    _warmup()
    dist.broadcast(torch.ones(4), src=0 if rank == 0 else 1)  # SRC_SITE
    dist.barrier()


def only_main_process(rank: int, world: int) -> None:
    _warmup()
    stats = torch.ones(2)
    if rank == 0:  # e.g. `if accelerator.is_main_process:` around logging that reduces a metric
        dist.all_reduce(stats)  # MAIN_ONLY_SITE


def crashed_rank(rank: int, world: int) -> None:
    _warmup()
    if rank == world - 1:
        os._exit(7)
    dist.all_reduce(torch.ones(4))  # CRASH_SITE


def straggler(rank: int, world: int) -> None:
    _warmup()
    if rank == world - 1:
        time.sleep(60)
    dist.all_reduce(torch.ones(4))  # STRAGGLER_SITE


def ddp_unused_parameter(rank: int, world: int) -> None:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    x = torch.ones(3, 4)
    out = model(x) if rank == 0 else model.module[0](x)  # rank 1 skips the second layer
    out.sum().backward()  # DDP_BACKWARD_SITE
    dist.all_reduce(torch.ones(4))  # DDP_NEXT_SITE


def session_hang(worker: object) -> dict[str, int]:
    """A custom rank command (``call_function``): rank 0 reduces a metric the other ranks never reduce."""
    rank = worker.rank  # type: ignore[attr-defined]
    if rank == 0:
        dist.all_reduce(torch.ones(3))  # SESSION_HANG_SITE
    return {"rank": rank}


# Point-to-point faults (p2p pairs are rank-conditional by nature).


def send_never_received(rank: int, world: int) -> None:
    _warmup()
    if rank == 0:
        dist.send(torch.ones(4), 1)  # UNRECEIVED_SEND_SITE
    dist.all_reduce(torch.ones(4))  # AFTER_SEND_SITE: rank 1 waits here; gloo's send waits for the recv


def recv_never_sent(rank: int, world: int) -> None:
    _warmup()
    if rank == 0:
        dist.recv(torch.empty(4), 1)  # UNSENT_RECV_SITE
    else:
        return  # rank 1 finishes the command without sending


def p2p_recv_too_small(rank: int, world: int) -> None:
    _warmup()
    if rank == 0:
        dist.send(torch.ones(6), 1)  # P2P_SEND_SITE
    else:
        dist.recv(torch.empty(4), 0)  # P2P_RECV_SITE: gloo aborts this rank (SIGABRT)


def p2p_recv_too_large(rank: int, world: int) -> None:
    _warmup()
    if rank == 0:
        dist.send(torch.ones(4), 1)  # P2P_SMALL_SEND_SITE
    else:
        dist.recv(torch.empty(6), 0)  # P2P_LARGE_RECV_SITE: gloo completes it silently


def ping_pong(rank: int, world: int, rounds: int = 50) -> None:
    _warmup()
    ball = torch.zeros(3)
    for _ in range(rounds):
        if rank == 0:
            dist.send(ball + 1, 1)
            dist.recv(ball, 1)
        else:
            dist.recv(ball, 0)
            dist.send(ball + 1, 0)
    dist.all_reduce(ball)


def recv_while_peer_reduces(rank: int, world: int) -> None:
    _warmup()
    if rank == 0:
        dist.recv(torch.empty(4), 1)  # RECV_VS_REDUCE_SITE
    else:
        dist.all_reduce(torch.ones(4))  # REDUCE_VS_RECV_SITE
