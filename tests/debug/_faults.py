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


# Harder patterns (issue 26).


def mesh_tp_skip(rank: int, world: int) -> None:
    """A 2x2 device mesh (data parallel x tensor parallel); the last rank's shard leaves it no TP all-reduce."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    dist.all_reduce(torch.ones(4), group=tp)
    dist.all_reduce(torch.ones(4), group=dp)
    chunks = 0 if rank == world - 1 else 1  # data-dependent: an empty shard
    for _ in range(chunks):
        dist.all_reduce(torch.ones(8), group=tp)  # TP_SKIP_SITE
    dist.all_reduce(torch.ones(2), group=dp)  # DP_AFTER_SITE


def async_issue_order(rank: int, world: int) -> None:
    _warmup()
    buckets = [torch.ones(4), torch.ones(8)]
    order = reversed(buckets) if rank == world - 1 else buckets  # e.g. a set iterated in a rank-dependent order
    works = [dist.all_reduce(bucket, async_op=True) for bucket in order]  # ASYNC_ISSUE_SITE
    for work in works:
        work.wait()


def async_wait_order(rank: int, world: int) -> None:
    """Clean: every rank issues in the same order; the last one waits in the other order (gloo runs them in issue
    order, so this completes)."""
    _warmup()
    works = [dist.all_reduce(torch.ones(4), async_op=True), dist.all_reduce(torch.ones(8), async_op=True)]
    for work in reversed(works) if rank == world - 1 else works:
        work.wait()
    dist.all_reduce(torch.ones(2))


def all_to_all_bad_splits(rank: int, world: int) -> None:
    _warmup()
    splits = [1, 3] if rank == 0 else [2, 2]  # rank 0 sends 3 rows to rank 1, which expects 2
    out, inp = torch.empty(4), torch.ones(4)
    dist.all_to_all_single(out, inp, output_split_sizes=splits, input_split_sizes=splits)  # A2A_SITE
    dist.barrier()


def all_to_all_uneven(rank: int, world: int) -> None:
    """Clean: uneven but consistent splits, inputs of different lengths per rank."""
    _warmup()
    send = [1, 2] if rank == 0 else [3, 2]
    receive = [1, 3] if rank == 0 else [2, 2]
    dist.all_to_all_single(
        torch.empty(sum(receive)), torch.ones(sum(send)), output_split_sizes=receive, input_split_sizes=send
    )
    dist.barrier()


def reduce_scatter_vs_all_gather(rank: int, world: int) -> None:
    _warmup()
    if rank == 0:
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(4))  # RS_SITE
    else:
        dist.all_gather_into_tensor(torch.empty(4), torch.ones(2))  # AG_SITE
    dist.barrier()


def background_thread_collective(rank: int, world: int) -> None:
    import threading

    from rlsdk.debug.tracer import get_tracer

    _warmup()
    if rank == 0:  # e.g. a metrics thread broadcasting a value on its own schedule
        threading.Thread(
            target=lambda: dist.broadcast(torch.ones(4), src=0),  # THREAD_SITE
            name="metrics-thread",
            daemon=True,
        ).start()
        while len(get_tracer().records) < 2:  # the thread's call is recorded first (deterministic order)
            time.sleep(0.01)
    dist.all_reduce(torch.ones(4))  # MAIN_AFTER_THREAD_SITE


def fsdp2_extra_layer(rank: int, world: int) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    hidden = [8, 16, 8] if rank == world - 1 else [8, 8]  # its model config has one more layer
    layers = [torch.nn.Linear(a, b) for a, b in zip([8, *hidden[:-1]], hidden, strict=True)]
    model = torch.nn.Sequential(*layers)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    model(torch.ones(2, 8)).sum().backward()  # FSDP_STEP_SITE


def monitored_barrier_skipped(rank: int, world: int) -> None:
    import datetime

    _warmup()
    if rank == world - 1:
        return  # an early exit (e.g. no more data) before the barrier
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=120), wait_all_ranks=True)  # MONITORED_SITE


def monitored_barrier_all(rank: int, world: int) -> None:
    """Clean: every rank passes the barrier, as users write it."""
    import datetime

    _warmup()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=60), wait_all_ranks=True)
    dist.all_reduce(torch.ones(2))


def blocked_on_python_lock(rank: int, world: int) -> None:
    import threading

    _warmup()
    if rank == world - 1:
        lock = threading.Lock()
        lock.acquire()  # held by "another thread" that never lets go (a stuck data loader, a logging handler)
        threading.Timer(60.0, lock.release).start()
        lock.acquire()  # LOCK_SITE
    dist.all_reduce(torch.ones(4))  # AFTER_LOCK_SITE


def killed_mid_collective(rank: int, world: int) -> None:
    """The last rank is SIGKILLed (what the kernel's OOM killer sends) while it waits in an all-reduce."""
    import signal
    import threading

    _warmup()
    if rank == world - 1:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    else:
        time.sleep(3.0)  # the others arrive after it died
    dist.all_reduce(torch.ones(4))  # KILLED_SITE


def diverge_after_clean_steps(rank: int, world: int, steps: int = 300, odd_step: int = 250) -> None:
    _warmup()
    grads = torch.ones(8)
    for step in range(steps):
        if rank == world - 1 and step == odd_step:  # a "bad batch" path, taken on one rank only
            dist.all_reduce(torch.zeros(8))  # OTHER_PATH_SITE: same tensors as the step's, so it matches silently
            dist.all_reduce(torch.ones(1))  # FLAG_SITE: a flag the other ranks never reduce
        else:
            dist.all_reduce(grads)  # STEP_SITE


def clean_harder_patterns(rank: int, world: int) -> None:
    """Clean: async calls waited in another order, uneven all-to-all splits, monitored_barrier on every rank."""
    async_wait_order(rank, world)
    all_to_all_uneven(rank, world)
    monitored_barrier_all(rank, world)


# Custom rank commands (``call_function``) for a real Session: each diverges, or is slow, in its own way.


def session_rank0_broadcast(worker: object) -> dict[str, int]:
    """The issue's probe: rank 0 broadcasts inside ``if rank == 0``."""
    rank = worker.rank  # type: ignore[attr-defined]
    if rank == 0:
        dist.broadcast(torch.ones(3), src=0)  # SESSION_BROADCAST_SITE
    return {"rank": rank}


def session_missing(worker: object) -> dict[str, int]:
    rank = worker.rank  # type: ignore[attr-defined]
    if rank == 1:
        return {"rank": rank}  # an early exit: no more data on this rank
    dist.all_reduce(torch.ones(3))  # SESSION_MISSING_SITE
    return {"rank": rank}


def session_op_mismatch(worker: object) -> None:
    if worker.rank == 0:  # type: ignore[attr-defined]
        dist.all_reduce(torch.ones(3))  # SESSION_OP_SITE
    else:
        dist.broadcast(torch.ones(3), src=0)


def session_source_mismatch(worker: object) -> None:
    dist.broadcast(torch.ones(3), src=worker.rank)  # type: ignore[attr-defined]  # SESSION_SRC_SITE


def session_reduce_op_mismatch(worker: object, sleep_s: float = 8.0) -> dict[str, float]:
    """gloo completes it with a wrong result; the command then computes on. (A ``reduce``: a Session's
    all-reduces go through shared memory, which checks the ranks' ops itself and raises at once.)"""
    value = torch.full((3,), 1.0 + worker.rank)  # type: ignore[attr-defined]
    dist.reduce(value, dst=0, op=dist.ReduceOp.MAX if worker.rank == 1 else dist.ReduceOp.SUM)  # type: ignore[attr-defined]
    time.sleep(sleep_s)
    return {"value": float(value[0])}


def session_shape_mismatch(worker: object) -> None:
    dist.broadcast(torch.ones(4 - worker.rank), src=0)  # type: ignore[attr-defined]  # SESSION_SHAPE_SITE: gloo aborts rank 1


def session_p2p_unmatched(worker: object) -> None:
    if worker.rank == 0:  # type: ignore[attr-defined]
        dist.send(torch.ones(3), 1)  # SESSION_SEND_SITE: rank 1 finishes without receiving


def session_p2p_cycle(worker: object) -> None:
    if worker.rank == 0:  # type: ignore[attr-defined]
        dist.recv(torch.empty(3), 1)  # SESSION_RECV_SITE
    else:
        dist.all_reduce(torch.ones(3))  # SESSION_CYCLE_REDUCE_SITE


def session_lock_straggler(worker: object, hold_s: float = 8.0) -> dict[str, int]:
    """Not a desync: rank 1 waits on a Python lock for ``hold_s`` seconds, then joins the all-reduce."""
    import threading

    rank = worker.rank  # type: ignore[attr-defined]
    if rank == 1:
        lock = threading.Lock()
        lock.acquire()
        threading.Timer(hold_s, lock.release).start()
        lock.acquire()  # SESSION_LOCK_SITE
    dist.all_reduce(torch.ones(3))
    return {"rank": rank}


# Harder patterns across groups, p2p rings and look-alike collectives (issue 39). Four ranks in a 2-D mesh: tensor
# parallel TP{0,1}{2,3} x data parallel DP{0,2}{1,3}.


def _mesh() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return mesh.get_group("tp"), mesh.get_group("dp")


def mesh_tp_skip_cycle(rank: int, world: int) -> None:
    """Rank 3 skips a TP all-reduce: rank 2 waits in TP{2,3}, rank 0 in DP{0,2} for rank 2, ranks 1 and 3 in the
    world barrier for ranks 0 and 2. The waits form a cycle through three groups."""
    _warmup()
    tp, dp = _mesh()
    dist.all_reduce(torch.ones(4), group=tp)
    dist.all_reduce(torch.ones(4), group=dp)
    chunks = 0 if rank == 3 else 1  # data-dependent: an empty shard on rank 3
    for _ in range(chunks):
        dist.all_reduce(torch.ones(8), group=tp)  # CYCLE_TP_SITE
    dist.all_reduce(torch.ones(2), group=dp)  # CYCLE_DP_SITE
    dist.barrier()  # CYCLE_BARRIER_SITE


def all_to_all_stale_splits(rank: int, world: int) -> None:
    """MoE token dispatch: each step exchanges the per-expert token counts, then the tokens. On the second step
    rank 1 reuses the first step's receive counts (a stale cache)."""
    _warmup()
    stale: list[int] = []
    for step in range(2):
        send = [(rank + peer + step) % 3 + 1 for peer in range(world)]  # tokens routed to each peer's expert
        counts = torch.empty(world, dtype=torch.int64)
        dist.all_to_all_single(counts, torch.tensor(send))
        receive = [int(n) for n in counts]
        if rank == 1 and step == 1:
            receive = stale  # STALE_COUNTS_SITE
        stale = receive
        out, tokens = torch.empty(sum(receive), 2), torch.ones(sum(send), 2)
        dist.all_to_all_single(out, tokens, output_split_sizes=receive, input_split_sizes=send)  # A2A_TOKENS_SITE
    dist.barrier()


def async_order_swap_mesh(rank: int, world: int) -> None:
    """Each rank all-reduces its attention and MLP gradients in its TP group, async; rank 2 issues them in the
    other order (it iterates a set of names)."""
    _warmup()
    tp, dp = _mesh()
    dist.all_reduce(torch.ones(4), group=dp)
    grads = {"attn": torch.ones(4), "mlp": torch.ones(8)}
    names = ["mlp", "attn"] if rank == 2 else ["attn", "mlp"]
    works = [dist.all_reduce(grads[name], group=tp, async_op=True) for name in names]  # SWAP_SITE
    for work in works:
        work.wait()
    dist.all_reduce(torch.ones(2), group=dp)


def ddp_bucket_skip_equal_shapes(rank: int, world: int) -> None:
    """A hand-written DDP: one gradient bucket per block, reduced in backward order. On the third step rank 1's
    config freezes the attention block, so it has no attention bucket, whose size equals the MLP bucket's."""
    _warmup()
    for step in range(3):
        frozen = {"attn"} if rank == 1 and step == 2 else set()
        dist.all_reduce(torch.ones(4))  # head bucket
        if "attn" not in frozen:
            dist.all_reduce(torch.ones(16))  # SKIPPED_BUCKET_SITE
        dist.all_reduce(torch.ones(16))  # MLP_BUCKET_SITE
        dist.all_reduce(torch.ones(8))  # embedding bucket
    dist.barrier()


def p2p_ring_reversed_pair(rank: int, world: int, rounds: int = 3) -> None:
    """A ring exchange with batch_isend_irecv (send right, receive left) for ``rounds`` rounds; on the last round
    rank 2 reverses its pair (sends left, receives right)."""
    _warmup()
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(rounds):
        send, recv = torch.ones(4), torch.empty(4)
        to, frm = (left, right) if rank == 2 and step == rounds - 1 else (right, left)
        ops = [dist.P2POp(dist.isend, send, to), dist.P2POp(dist.irecv, recv, frm)]
        for work in dist.batch_isend_irecv(ops):  # RING_SITE
            work.wait()
    dist.all_reduce(torch.ones(2))  # AFTER_RING_SITE


def clean_mesh_async(rank: int, world: int) -> None:
    """Clean: a 2-D mesh step with async TP all-reduces waited in another order, a DP all-gather and reduce-scatter,
    an uneven but consistent all-to-all in the DP group, a batch_isend_irecv ring both ways, and a barrier."""
    _warmup()
    tp, dp = _mesh()
    for _ in range(3):
        works = [dist.all_reduce(torch.ones(n), group=tp, async_op=True) for n in (4, 8)]
        for work in reversed(works) if rank % 2 else works:
            work.wait()
        gathered = torch.empty(8)
        dist.all_gather_into_tensor(gathered, torch.ones(4), group=dp, async_op=True).wait()
        dist.reduce_scatter_tensor(torch.empty(4), gathered, group=dp)
        me = dist.get_rank(dp)
        send, receive = ([1, 2], [1, 3]) if me == 0 else ([3, 2], [2, 2])
        dist.all_to_all_single(torch.empty(sum(receive)), torch.ones(sum(send)), receive, send, group=dp)
        right, left = (rank + 1) % world, (rank - 1) % world
        ops = [
            dist.P2POp(dist.isend, torch.ones(2), right),
            dist.P2POp(dist.irecv, torch.empty(2), left),
            dist.P2POp(dist.isend, torch.ones(3), left),
            dist.P2POp(dist.irecv, torch.empty(3), right),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    dist.barrier()


# What the analyser must say about each pattern above, and the check tests and benchmarks/root_cause_soak.py share.
# name: (kind, faulty ranks, ranks of the diverging group, seq, call-site markers among the sides, certain);
# None: a clean control (no divergence).
ROOT_CAUSE_PATTERNS: dict[str, tuple[str, list[int], list[int], int, list[str], bool] | None] = {
    "mesh_tp_skip_cycle": ("missing collective", [3], [2, 3], 2, ["CYCLE_TP_SITE", "CYCLE_BARRIER_SITE"], True),
    "all_to_all_stale_splits": ("shape mismatch", [1], [0, 1, 2, 3], 5, ["A2A_TOKENS_SITE"], True),
    "async_order_swap_mesh": ("shape mismatch", [2], [2, 3], 1, ["SWAP_SITE"], True),
    "ddp_bucket_skip_equal_shapes": (
        "missing collective",
        [1],
        [0, 1, 2, 3],
        11,
        ["SKIPPED_BUCKET_SITE", "MLP_BUCKET_SITE"],
        True,
    ),
    "p2p_ring_reversed_pair": ("p2p unmatched", [2], [0, 1, 2, 3], 5, ["RING_SITE"], False),
    "clean_mesh_async": None,
}


def marker_site(marker: str) -> str:
    """``file:line`` of the line of this module carrying ``# MARKER``."""
    path = os.path.abspath(__file__)
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if f"# {marker}" in line:
                return f"{path}:{number}"
    raise KeyError(marker)


def verdict(report: object) -> tuple[object, ...] | None:
    """What must be the same on every run: kind, ranks, the diverging group's ranks, seq, certain and call sites."""
    div = report.divergence  # type: ignore[attr-defined]
    if div is None:
        return None
    states = report.states  # type: ignore[attr-defined]
    # the group's ranks as a live member reports them; when every member died, the ranks holding its records
    group = next((st["groups"][div.group]["ranks"] for st in states.values() if div.group in (st.get("groups") or {})),
                 None) or sorted(rank for rank, st in states.items() if any(rec["group"] == div.group and not
                                 rec.get("p2p") for rec in st.get("records", ())))  # fmt: skip
    sites = tuple(sorted({side["record"]["site"] for side in div.sides if side.get("record")}))
    return (div.kind, tuple(div.ranks), tuple(group or ()), div.seq, div.certain, sites)


def root_cause_problems(name: str, report: object, seconds: float, limit_s: float = 5.0) -> list[str]:
    """Every way a diagnosis of pattern ``name`` misses :data:`ROOT_CAUSE_PATTERNS` (empty: right)."""
    expected = ROOT_CAUSE_PATTERNS[name]
    div = report.divergence  # type: ignore[attr-defined]
    if expected is None:
        return [] if div is None else [f"a clean program drew a report: {div.headline()}"]
    kind, ranks, group, seq, markers, certain = expected
    if div is None:
        return ["no divergence found"]
    got = verdict(report)
    assert got is not None
    problems = []
    if got[:4] != (kind, tuple(ranks), tuple(group), seq):
        problems.append(f"verdict {got[:4]} != {(kind, tuple(ranks), tuple(group), seq)}")
    if div.certain and got[:4] != (kind, tuple(ranks), tuple(group), seq):
        problems.append("a certain verdict that is wrong")
    if div.certain != certain:
        problems.append(f"certain={div.certain}, expected {certain}")
    missing = [marker for marker in markers if marker_site(marker) not in got[5]]
    if missing:
        problems.append(f"call sites {missing} not among the sides {got[5]}")
    if seconds > limit_s:
        problems.append(f"diagnosed after {seconds:.1f} s (> {limit_s} s)")
    return problems
