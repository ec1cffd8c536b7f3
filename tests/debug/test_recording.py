"""The traced backend records user collectives, p2p and DDP's C++ all-reduces on real gloo ranks."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from rlsdk.debug.tracer import FIELDS
from rlsdk.testing.distributed import run_gloo_ranks

pytestmark = pytest.mark.distributed


def _marker_line(marker: str) -> int:
    """The line of this file whose comment is ``# {marker}`` (the call sites the records must name)."""
    lines = open(__file__).read().splitlines()  # noqa: SIM115 - one short read
    return next(number for number, line in enumerate(lines, 1) if line.rstrip().endswith(f"# {marker}"))


def _record_everything(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from rlsdk.debug import tracer

    tracer.init_traced_process_group()
    tracer.set_command("update", 7)
    t = torch.ones(4)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # USER_SITE
    dist.broadcast(torch.zeros(2, 3, dtype=torch.float64), src=1)
    if rank == 0:  # p2p pairs are legitimately rank-conditional
        dist.send(t, 1)  # rlsdk: allow-conditional-collective
    else:
        dist.recv(t, 0)  # rlsdk: allow-conditional-collective
    sub = dist.new_group([0, 1], backend="traced")
    dist.all_reduce(t, group=sub)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.ones(3, 4)).sum().backward()  # DDP_SITE
    dist.all_reduce(t, async_op=True).wait()
    dist.monitored_barrier(wait_all_ranks=True)  # as users write it (torch alone rejects the backend's name)
    dist.all_to_all_single(torch.empty(2), torch.ones(2), [1, 1], [1, 1])
    tracer.set_command(None, None)
    assert dist.get_world_size() == world
    # gloo marks a Work completed on its own thread, possibly just after DDP's backward returned: poll briefly
    deadline = time.monotonic() + 5.0
    snap = tracer.snapshot()
    while any(r["t_end"] is None for r in snap["records"]) and time.monotonic() < deadline:
        time.sleep(0.01)
        snap = tracer.snapshot()
    return snap


def test_traced_group_records_user_p2p_subgroup_and_ddp_collectives_with_sites() -> None:
    snaps = run_gloo_ranks(_record_everything, 2)

    for rank, snap in enumerate(snaps):
        records = snap["records"]
        world = [r for r in records if r["group"] == "0" and not r["p2p"]]
        first = world[0]
        assert (first["op"], first["seq"], first["reduce_op"], first["shapes"]) == ("allreduce", 1, "MAX", ((4,),))
        assert first["site"].endswith(f"test_recording.py:{_marker_line('USER_SITE')}") and (
            first["command"],
            first["command_seq"],
        ) == (
            "update",
            7,
        )
        assert world[1]["op"] == "broadcast" and world[1]["root"] == 1 and world[1]["dtypes"] == ("float64",)
        p2p = [r for r in records if r["p2p"]]
        assert [(r["op"], r["seq"], r["root"]) for r in p2p] == [("send" if rank == 0 else "recv", 1, 1 - rank)]
        sub = [r for r in records if r["group"] not in ("0",) and not r["p2p"]]
        assert [(r["op"], r["seq"]) for r in sub] == [("allreduce", 1)]
        ddp = [r for r in world if r["site"].endswith(f"test_recording.py:{_marker_line('DDP_SITE')}")]
        assert ddp and ddp[-1]["op"] == "allreduce" and ddp[-1]["shapes"] == ((10,),)  # the gradient bucket
        assert all(r["t_end"] is not None for r in records)
        assert [r["seq"] for r in world] == list(range(1, len(world) + 1))
        # what the certainty rules need: which calls block their thread, which thread, how far each group got
        assert first["sync"] and p2p[0]["sync"] and not ddp[-1]["sync"]
        assert all(r["thread"] == snap["main_thread"] for r in records)
        after_ddp = world[world.index(ddp[-1]) + 1 :]
        assert [(r["op"], r["sync"]) for r in after_ddp] == [
            ("allreduce", False), ("monitored_barrier", True), ("all_to_all_single", True)
        ]  # fmt: skip
        assert after_ddp[-1]["splits"] == ((1, 1), (1, 1))
        assert snap["heads"]["0"] == len(world) and snap["last_command_seq"] == 7 and snap["command"] is None
        assert snap["peer_heads"] == {f"0|{'send' if rank == 0 else 'recv'}|{1 - rank}": 1}
        assert [r["index"] for r in records] == list(range(len(records)))


def _clean_ddp_steps(rank: int, world: int, steps: int) -> dict[str, Any]:
    import torch

    from rlsdk.debug import tracer

    tracer.init_traced_process_group()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return tracer.snapshot()


@pytest.mark.slow  # ~15 s on 2 shared cores
def test_two_thousand_clean_ddp_steps_give_no_divergence() -> None:
    from rlsdk.debug.analyze import analyze

    snaps = run_gloo_ranks(_clean_ddp_steps, 2, 2000)

    report = analyze(dict(enumerate(snaps)))
    assert report.ok, str(report)
    assert all(len(snap["records"]) >= 2000 for snap in snaps)


class _FakeWork:
    """A Work holding a tensor, as gloo's does, completed when told."""

    def __init__(self, done: bool) -> None:
        self.done = done
        self.tensor = torch.zeros(4)

    def is_completed(self) -> bool:
        return self.done


def test_tracer_drops_completed_works_so_their_tensors_are_freed_and_keeps_pending_ones() -> None:
    import weakref

    from rlsdk.debug.tracer import Tracer

    tracer = Tracer(capacity=16)
    works = [_FakeWork(done=index != 1) for index in range(4)]  # call 1 stays in flight
    alive = [weakref.ref(work) for work in works]

    for work in works:
        tracer.track(tracer.record("0", False, "allreduce", [work.tensor], "SUM", None), work)
    del works, work

    held = [rec[FIELDS.index("seq")] for rec, _ in tracer.polled]
    assert held == [2, 4]  # 1 and 3 left as soon as the next call saw them completed; 2 is still in flight
    assert alive[0]() is None and alive[2]() is None  # the completed calls' tensors are no longer referenced
    assert alive[1]() is not None
    assert [rec[FIELDS.index("t_end")] is not None for rec in tracer.records] == [True, False, True, False]
