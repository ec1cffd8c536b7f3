"""Shared helpers for the control-channel tests: a tiny rank command loop, run in threads or spawned processes."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from rlsdk.control import SHUTDOWN, ControllerChannel, RankChannel, new_session_id, new_session_secret

T = TypeVar("T")

# Short enough that a test sees heartbeats within a fraction of a second.
FAST_HEARTBEAT_S = 0.1


def failing_function(rank: int) -> None:
    """Raises with a distinctive name, so tests can find it in the remote traceback."""
    raise ValueError(f"boom on rank {rank}")


def handle(channel: RankChannel, name: str, body: Any) -> Any:
    """The test commands every rank understands."""
    rank = channel.rank
    if name == "echo":
        return {"rank": rank, "body": body}
    if name == "add":
        return body["x"] + rank
    if name == "boom":
        if rank in body["ranks"]:
            failing_function(rank)
        time.sleep(body.get("others_delay_s", 0.0))
        return "ok"
    if name == "logs":
        for index in range(body["count"]):
            channel.send_log({"name": "test", "levelno": 20, "message": f"rank {rank} record {index}", "i": index})
        return body["count"]
    if name == "unpicklable":
        return threading.Lock()
    if name == "sleep":
        channel.set_progress(1, 2)  # reported by the heartbeats while sleeping
        time.sleep(body["seconds"][rank])
        return rank
    raise KeyError(f"unknown test command {name!r}")


def serve(channel: RankChannel, stop: threading.Event | None = None, flush_timeout_s: float = 1.0) -> None:
    """The rank command loop: connect, execute commands in order, reply; exit on shutdown or ``stop``."""
    channel.connect()
    try:
        while stop is None or not stop.is_set():
            command = channel.recv_command(timeout_s=0.1)
            if command is None:
                continue
            if command.name == SHUTDOWN:
                return
            try:
                value = handle(channel, command.name, command.body)
            except Exception as exc:
                channel.send_error(command.seq, exc)
            else:
                channel.send_result(command.seq, value)
    finally:
        channel.close(flush_timeout_s=flush_timeout_s)


def rank_process_main(rank: int, world_size: int, env: Mapping[str, str]) -> None:
    """Entry point of a spawned rank process: the environment carries the address and the secret."""
    os.environ.update(env)
    serve(RankChannel.from_env(rank, world_size))


@contextmanager
def rank_threads(
    channel: ControllerChannel, world_size: int, secret: bytes, session_id: str, **rank_kwargs: Any
) -> Iterator[list[RankChannel]]:
    """Run ``world_size`` ranks as threads of this process; join them on exit."""
    rank_kwargs.setdefault("heartbeat_interval_s", FAST_HEARTBEAT_S)
    rank_kwargs.setdefault("heartbeat_timeout_s", 30.0)
    ranks = [
        RankChannel(rank, world_size, channel.address, secret, session_id, **rank_kwargs) for rank in range(world_size)
    ]
    stop = threading.Event()
    # A short flush: some tests close the controller first, and then nothing will read what is left.
    threads = [threading.Thread(target=serve, args=(rank, stop, 0.2), daemon=True) for rank in ranks]
    for thread in threads:
        thread.start()
    try:
        yield ranks
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=5.0)


@contextmanager
def rank_processes(env: Mapping[str, str], world_size: int) -> Iterator[list[multiprocessing.Process]]:
    """Spawn ``world_size`` rank processes; on exit wait for them briefly, then terminate what is left."""
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=rank_process_main, args=(rank, world_size, dict(env)), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    try:
        yield processes
    finally:
        deadline = time.monotonic() + 5.0
        for process in processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=2.0)


def new_controller(**kwargs: Any) -> tuple[ControllerChannel, bytes, str]:
    """A controller channel (not started) with a fresh secret and session id."""
    secret = new_session_secret()
    session_id = new_session_id()
    kwargs.setdefault("heartbeat_interval_s", FAST_HEARTBEAT_S)
    return ControllerChannel(secret, session_id, **kwargs), secret, session_id


def run(coroutine_function: Callable[[], Coroutine[Any, Any, T]], timeout_s: float = 15.0) -> T:
    """Run an async test body in a fresh event loop, with an overall time limit."""

    async def limited() -> T:
        return await asyncio.wait_for(coroutine_function(), timeout_s)

    return asyncio.run(limited())
