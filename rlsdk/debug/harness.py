"""Run a function on N real traced gloo ranks and diagnose it live, as the Session's watchdog does.

``diagnose(fn, world_size, *args)`` starts ``world_size`` spawned processes, each with a control channel to
this process, a ``traced`` default process group and the ``trace`` query installed; each calls
``fn(rank, world_size, *args)`` on its main thread. Meanwhile the caller polls every rank's tracer through the
event threads (which answer while main threads are stuck in collectives), and returns the first divergence
seen on two polls in a row (or the last report at the deadline). The ranks are then killed: nothing survives
the call. The process-group timeout is left at torch's default (or ``pg_timeout_s``): the diagnosis does not
wait for it.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlsdk.debug.analyze import TraceReport, analyze
from rlsdk.debug.watchdog import collect_states

__all__ = ["Diagnosis", "diagnose"]


@dataclass
class Diagnosis:
    """What :func:`diagnose` saw: the report, seconds from the ranks' start of ``fn`` to it, and the latency."""

    report: TraceReport
    seconds: float
    polls: int
    pids: list[int]
    latency_s: float | None = None
    """Seconds from the diverging call (the latest ``t_start`` among the sides' records at the divergence; rank
    and controller share the machine's monotonic clock) to the diagnosis; ``None`` without a divergence."""


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, env: dict[str, str], args: tuple) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
    from rlsdk.launch.pdeathsig import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)
    import torch

    torch.set_num_threads(1)
    from rlsdk.control.rank import RankChannel
    from rlsdk.debug import tracer
    from rlsdk.debug.rank import install_trace_query

    channel = RankChannel.from_env(rank, world_size, on_controller_lost=lambda: os._exit(3))
    install_trace_query(channel)
    from rlsdk.launch.rendezvous import rank_store

    timeout = env.get("RLSDK_PG_TIMEOUT_S")
    tracer.init_traced_process_group(float(timeout) if timeout else None, store=rank_store(world_size))
    channel.connect()
    # Wait for the controller's "run": a rank that aborts right after connecting could lose its queued hello.
    command = channel.recv_command()
    channel.send_result(command.seq, None)
    tracer.set_command(command.name, command.seq)
    channel.set_current(command.name, command.seq)
    try:
        fn(rank, world_size, *args)
    except BaseException as exc:  # the rank survives to report (a peer's abort resets its connection)
        tracer.get_tracer().errors.append(f"{type(exc).__name__}: {exc}")
    tracer.set_command(None, None)
    channel.set_current(None, None)
    while True:  # idle until the controller kills this process
        time.sleep(1.0)


def _latency(div: Any) -> float | None:
    starts = [
        float(side["record"]["t_start"])
        for side in div.sides
        if side.get("record") and side["record"].get("seq") == div.seq and side["record"].get("group") == div.group
    ]
    return time.monotonic() - max(starts) if starts else None


def _wait_s(states: dict[int, dict[str, Any]], div: Any) -> float:
    side = div.sides[0]
    record, state = side.get("record") or {}, states.get(side["rank"], {})
    if "t_start" not in record or "now" not in state:
        return 0.0
    return float(state["now"]) - float(record["t_start"])


async def _diagnose(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    within_s: float,
    poll_s: float,
    pg_timeout_s: float | None,
    site_check: Any,
    straggler_after_s: float,
) -> Diagnosis:
    from rlsdk.control import ControllerChannel, new_session_id, new_session_secret
    from rlsdk.launch.rendezvous import one_machine_environment
    from rlsdk.runtime_dir import SessionRuntimeDir

    secret = new_session_secret()
    # As a Session on one machine: the channel's Unix socket and the ranks' rendezvous files in a private directory.
    runtime = SessionRuntimeDir()
    channel = ControllerChannel(
        secret, new_session_id(), socket_dir=runtime.path, heartbeat_interval_s=0.5, on_log=lambda record: None
    )
    await channel.start()
    tail_dir = tempfile.mkdtemp(prefix="rlsdk-trace-")
    env = {
        **channel.rank_environment(heartbeat_timeout_s=30.0),
        **one_machine_environment(runtime.path),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        "RLSDK_TRACE_DIR": tail_dir,
    }
    if pg_timeout_s is not None:
        env["RLSDK_PG_TIMEOUT_S"] = repr(pg_timeout_s)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, env, args), daemon=True) for r in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        await channel.wait_for_ranks(world_size, 120.0)
        await channel.broadcast("fault", timeout_s=60.0)
        start = time.monotonic()
        previous: tuple[Any, ...] | None = None
        polls = 0
        report = analyze({})
        while True:
            await asyncio.sleep(poll_s)
            polls += 1
            states = await collect_states(
                channel, world_size, 1.0, tail_dir=tail_dir, exit_codes=lambda r: procs[r].exitcode
            )
            if any(state.get("crashed") and procs[rank].exitcode is None for rank, state in states.items()):
                continue  # alive but slow to answer (a loaded machine): ask again rather than call it crashed
            report = analyze(states, site_check=site_check)
            div = report.divergence
            if div is not None and div.kind == "straggler" and _wait_s(states, div) < straggler_after_s:
                previous = None  # e.g. one rank still building DDP: call it a straggler only once it lasts
                continue
            key = None if div is None else (div.kind, tuple(div.ranks), div.group, div.seq)
            if key is not None and key == previous:
                return Diagnosis(
                    report, time.monotonic() - start, polls, [p.pid for p in procs if p.pid], _latency(div)
                )
            previous = key
            if time.monotonic() - start > within_s:
                return Diagnosis(report, time.monotonic() - start, polls, [p.pid for p in procs if p.pid])
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            if proc.pid is not None:
                proc.join(10)
        await channel.close()
        runtime.remove()
        for name in os.listdir(tail_dir):
            os.unlink(os.path.join(tail_dir, name))
        os.rmdir(tail_dir)


def diagnose(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    within_s: float = 60.0,
    poll_s: float = 0.3,
    pg_timeout_s: float | None = None,
    site_check: Callable[[str], bool] | None = None,
    straggler_after_s: float = 3.0,
) -> Diagnosis:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` traced gloo ranks and diagnose it live.

    ``fn`` must be importable (module level). Returns once the same divergence was seen on two polls in a
    row (a straggler: once the waiting ranks have waited ``straggler_after_s``), or after ``within_s`` seconds
    with the last report. Every rank process is killed before returning.
    """
    return asyncio.run(_diagnose(fn, world_size, args, within_s, poll_s, pg_timeout_s, site_check, straggler_after_s))
