"""The channel with every rank in its own spawned process, connected through the environment contract."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import zmq
from _control_helpers import new_controller, rank_processes, run

from rlsdk.control import RankError

pytestmark = pytest.mark.distributed

SPAWN_TIMEOUT_S = 15.0


@pytest.mark.parametrize("world_size", [2, 4])
def test_commands_to_rank_processes_return_results_in_rank_order(world_size: int) -> None:
    async def body() -> dict[str, Any]:
        channel, _, _ = new_controller()
        async with channel:
            with rank_processes(channel.rank_environment(heartbeat_timeout_s=30.0), world_size) as processes:
                hellos = await channel.wait_for_ranks(world_size, timeout_s=SPAWN_TIMEOUT_S)
                shared = await channel.broadcast("echo", {"step": 1}, timeout_s=5.0)
                per_rank = await channel.broadcast("echo", [{"shard": r * 10} for r in range(world_size)])
                added = await channel.broadcast("add", {"x": 100}, timeout_s=5.0)
                await channel.shutdown_ranks()
                pids = [process.pid for process in processes]
            exit_codes = [process.exitcode for process in processes]
        return {
            "hellos": hellos,
            "shared": shared,
            "per_rank": per_rank,
            "added": added,
            "pids": pids,
            "exit_codes": exit_codes,
        }

    out = run(body, timeout_s=30.0)

    assert out["shared"] == [{"rank": r, "body": {"step": 1}} for r in range(world_size)]
    assert out["per_rank"] == [{"rank": r, "body": {"shard": r * 10}} for r in range(world_size)]
    assert out["added"] == [100 + r for r in range(world_size)]
    assert [out["hellos"][r]["pid"] for r in range(world_size)] == out["pids"]
    assert out["exit_codes"] == [0] * world_size


def test_rank_process_raising_gives_rank_error_with_remote_traceback() -> None:
    async def body() -> RankError:
        channel, _, _ = new_controller()
        async with channel:
            with rank_processes(channel.rank_environment(heartbeat_timeout_s=30.0), 2):
                await channel.wait_for_ranks(2, timeout_s=SPAWN_TIMEOUT_S)
                with pytest.raises(RankError) as info:
                    await channel.broadcast("boom", {"ranks": [1]}, timeout_s=5.0)
                # The failure is per command: the ranks keep serving.
                assert await channel.broadcast("add", {"x": 0}, timeout_s=5.0) == [0, 1]
                await channel.shutdown_ranks()
        return info.value

    error = run(body, timeout_s=30.0)

    assert (error.rank, error.command, error.exc_type) == (1, "boom", "ValueError")
    text = str(error)
    assert "rank 1" in text and "'boom'" in text and "ValueError: boom on rank 1" in text
    assert "failing_function" in text and "Traceback (most recent call last)" in text


def test_log_records_from_rank_processes_arrive_complete_and_in_order() -> None:
    count = 2000
    received: dict[int, list[int]] = {0: [], 1: []}

    def on_log(record: dict[str, Any]) -> None:
        received[record["rank"]].append(record["i"])

    async def body() -> None:
        channel, _, _ = new_controller(on_log=on_log)
        async with channel:
            with rank_processes(channel.rank_environment(heartbeat_timeout_s=30.0), 2):
                await channel.wait_for_ranks(2, timeout_s=SPAWN_TIMEOUT_S)
                started = time.monotonic()
                assert await channel.broadcast("logs", {"count": count}, timeout_s=10.0) == [count, count]
                # Logs travel on the event socket, results on the command socket: wait for the tail.
                while min(len(v) for v in received.values()) < count and time.monotonic() - started < 10.0:
                    await asyncio.sleep(0.02)
                await channel.shutdown_ranks()

    run(body, timeout_s=30.0)

    assert received[0] == list(range(count))
    assert received[1] == list(range(count))


def test_rank_process_exits_with_status_3_when_the_controller_goes_away() -> None:
    async def body() -> list[int | None]:
        channel, _, _ = new_controller(heartbeat_interval_s=0.1)
        await channel.start()
        env = channel.rank_environment(heartbeat_timeout_s=0.5)
        with rank_processes(env, 1) as processes:
            await channel.wait_for_ranks(1, timeout_s=SPAWN_TIMEOUT_S)
            assert await channel.broadcast("add", {"x": 1}, timeout_s=5.0) == [1]
            await channel.close()  # heartbeats stop; no shutdown is sent
            deadline = time.monotonic() + 5.0
            while processes[0].exitcode is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return [process.exitcode for process in processes]

    assert run(body, timeout_s=30.0) == [3]


@pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE; the TCP channel refuses to start")
def test_tcp_channel_with_curve_serves_rank_processes_that_hold_the_secret() -> None:
    async def body() -> tuple[str, list[Any]]:
        channel, _, _ = new_controller(host="127.0.0.1")
        async with channel:
            with rank_processes(channel.rank_environment(heartbeat_timeout_s=30.0), 2):
                await channel.wait_for_ranks(2, timeout_s=SPAWN_TIMEOUT_S)
                added = await channel.broadcast("add", {"x": 5}, timeout_s=5.0)
                await channel.shutdown_ranks()
        return channel.address, added

    address, added = run(body, timeout_s=30.0)

    assert address.startswith("tcp://127.0.0.1:")
    assert added == [5, 6]
