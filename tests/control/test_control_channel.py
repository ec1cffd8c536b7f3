"""Controller and rank ends over real zmq sockets on loopback, with ranks running as threads of this process."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import zmq
from _control_helpers import new_controller, rank_threads, run

from rlsdk.control import (
    SHUTDOWN,
    CommandTimeoutError,
    ControlError,
    RankChannel,
    RankError,
    new_session_secret,
    protocol,
)


def test_broadcast_to_two_thread_ranks_returns_results_in_rank_order() -> None:
    async def body() -> None:
        channel, secret, session_id = new_controller()
        async with channel:
            with rank_threads(channel, 2, secret, session_id):
                hellos = await channel.wait_for_ranks(2, timeout_s=5.0)
                results = await channel.broadcast("add", {"x": 10}, timeout_s=5.0)
                await channel.shutdown_ranks()

        assert results == [10, 11]
        assert sorted(hellos) == [0, 1]
        assert hellos[1]["world_size"] == 2

    run(body)


def test_broadcast_when_a_rank_result_cannot_be_pickled_raises_rank_error_instead_of_hanging() -> None:
    async def body() -> None:
        channel, secret, session_id = new_controller()
        async with channel:
            with rank_threads(channel, 1, secret, session_id):
                await channel.wait_for_ranks(1, timeout_s=5.0)
                with pytest.raises(RankError) as info:
                    await channel.broadcast("unpicklable", timeout_s=5.0)
                assert await channel.broadcast("add", {"x": 3}, timeout_s=5.0) == [3]
                await channel.shutdown_ranks()

        assert info.value.command == "unpicklable"
        assert "cannot send" in info.value.message and "lock" in info.value.message

    run(body)


def test_broadcast_with_unpicklable_body_raises_locally_and_keeps_the_channel_usable() -> None:
    async def body() -> None:
        channel, secret, session_id = new_controller()
        async with channel:
            with rank_threads(channel, 1, secret, session_id):
                await channel.wait_for_ranks(1, timeout_s=5.0)
                with pytest.raises(TypeError):
                    await channel.broadcast("echo", {"lock": threading.Lock()}, timeout_s=5.0)
                assert await channel.broadcast("add", {"x": 4}, timeout_s=5.0) == [4]
                await channel.shutdown_ranks()

    run(body)


def test_broadcast_when_a_rank_is_silent_raises_timeout_naming_the_rank_and_its_command() -> None:
    async def body() -> None:
        channel, secret, session_id = new_controller()
        async with channel:
            with rank_threads(channel, 2, secret, session_id):
                await channel.wait_for_ranks(2, timeout_s=5.0)
                started = time.monotonic()
                with pytest.raises(CommandTimeoutError) as info:
                    await channel.broadcast("sleep", {"seconds": [0.0, 1.0]}, timeout_s=0.4)
                elapsed = time.monotonic() - started
                await channel.shutdown_ranks()

        error = info.value
        assert error.missing_ranks == [1]
        assert error.current_commands == {1: "sleep"}
        assert error.heartbeat_ages[1] is not None and error.heartbeat_ages[1] < 0.5
        assert "rank 1" in str(error) and "'sleep'" in str(error) and "rank 0" not in str(error)
        assert isinstance(error, TimeoutError)
        assert 0.35 < elapsed < 0.9

    run(body)


def test_late_reply_after_rank_error_is_discarded_and_next_command_works(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="rlsdk.control")

    async def body() -> None:
        channel, secret, session_id = new_controller()
        async with channel:
            with rank_threads(channel, 2, secret, session_id):
                await channel.wait_for_ranks(2, timeout_s=5.0)
                with pytest.raises(RankError) as info:
                    await channel.broadcast("boom", {"ranks": [0], "others_delay_s": 0.1}, timeout_s=5.0)
                await asyncio.sleep(0.3)  # rank 1's "ok" for the failed command arrives late
                assert await channel.broadcast("add", {"x": 1}, timeout_s=5.0) == [1, 2]
                await channel.shutdown_ranks()

        assert info.value.rank == 0
        assert info.value.exc_type == "ValueError"
        assert "failing_function" in info.value.remote_traceback

    run(body)
    assert any("discarding a late" in record.getMessage() for record in caplog.records)


def test_message_signed_with_wrong_secret_is_dropped_counted_and_warned(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rlsdk.control")

    async def body() -> None:
        channel, secret, session_id = new_controller()
        async with channel:
            impostor = RankChannel(0, 1, channel.address, new_session_secret(), session_id)
            impostor.connect()
            try:
                with pytest.raises(TimeoutError, match=r"\[0\]"):
                    await channel.wait_for_ranks(1, timeout_s=0.5)
            finally:
                impostor.close(flush_timeout_s=0.0)
            assert channel.dropped_messages >= 1
            assert channel.ranks == {}
            # The channel still works for a rank holding the right secret.
            with rank_threads(channel, 1, secret, session_id):
                await channel.wait_for_ranks(1, timeout_s=5.0)
                assert await channel.broadcast("add", {"x": 5}, timeout_s=5.0) == [5]
                await channel.shutdown_ranks()

    run(body)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("has not said hello" in text and "AuthenticationError" in text for text in warnings)


def test_message_with_wrong_session_id_is_dropped_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rlsdk.control")

    async def body() -> None:
        channel, secret, _ = new_controller()
        async with channel:
            stale = RankChannel(0, 1, channel.address, secret, "an-earlier-session")
            stale.connect()
            try:
                with pytest.raises(TimeoutError):
                    await channel.wait_for_ranks(1, timeout_s=0.5)
            finally:
                stale.close(flush_timeout_s=0.0)
            assert channel.dropped_messages >= 1

    run(body)
    assert any("SessionMismatchError" in r.getMessage() for r in caplog.records)


def test_malformed_frames_and_unknown_peers_are_dropped_without_breaking_the_channel(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="rlsdk.control")

    async def body() -> None:
        channel, secret, session_id = new_controller()
        async with channel:
            context = zmq.Context()
            try:
                garbage = context.socket(zmq.DEALER)
                garbage.setsockopt(zmq.IDENTITY, b"evt-0")
                garbage.setsockopt(zmq.LINGER, 0)
                garbage.connect(channel.address)
                garbage.send_multipart([b"one frame"])
                garbage.send_multipart([b"{not json", b"", b"x" * 32])
                stranger = context.socket(zmq.DEALER)
                stranger.setsockopt(zmq.IDENTITY, b"intruder")
                stranger.setsockopt(zmq.LINGER, 0)
                stranger.connect(channel.address)
                stranger.send_multipart(
                    protocol.encode(secret, sender="rank", kind="hello", seq=0, rank=0, session=session_id, counter=1)
                )
                # A hello that does not name the routing id it arrives on is not accepted either.
                garbage.send_multipart(
                    protocol.encode(
                        secret, sender="rank", kind="hello", seq=0, rank=0, session=session_id, counter=1,
                        body={"rank": 0, "stream": "evt", "identity": b"someone-else".hex()},
                    )
                )  # fmt: skip
                deadline = time.monotonic() + 5.0
                while channel.dropped_messages < 4 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                garbage.close()
                stranger.close()
            finally:
                context.term()
            assert channel.dropped_messages == 4
            assert channel.ranks == {}
            with rank_threads(channel, 1, secret, session_id):
                await channel.wait_for_ranks(1, timeout_s=5.0)
                assert await channel.broadcast("add", {"x": 2}, timeout_s=5.0) == [2]
                await channel.shutdown_ranks()

    run(body)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert b"intruder".hex() in text and "malformed hello body" in text
    assert b"evt-0".hex() in text and "sent 1 frames" in text and "AuthenticationError" in text
    assert "this routing id expected" in text


def test_restarted_rank_reconnecting_registers_again_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="rlsdk.control")

    def registered_again() -> bool:
        return any("rank 0 registered again" in record.getMessage() for record in caplog.records)

    async def body() -> None:
        channel, secret, session_id = new_controller()
        async with channel:
            first = RankChannel(0, 1, channel.address, secret, session_id)
            first.connect()
            await channel.wait_for_ranks(1, timeout_s=5.0)
            first.close(flush_timeout_s=0.0)
            # No pause: the old connection may not be torn down yet when the new one arrives.
            with rank_threads(channel, 1, secret, session_id):
                deadline = time.monotonic() + 5.0
                while not registered_again() and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert registered_again()
                results = await channel.broadcast("add", {"x": 7}, timeout_s=5.0)
                await channel.shutdown_ranks()

        assert results == [7]

    run(body)


def test_wait_for_ranks_timeout_names_the_ranks_that_never_said_hello() -> None:
    async def body() -> None:
        channel, secret, session_id = new_controller()
        async with channel:
            rank = RankChannel(0, 3, channel.address, secret, session_id)
            rank.connect()
            try:
                with pytest.raises(TimeoutError, match=r"rank\(s\) \[1, 2\] of 3"):
                    await channel.wait_for_ranks(3, timeout_s=0.5)
                assert list(channel.ranks) == [0]
            finally:
                rank.close(flush_timeout_s=0.0)

    run(body)


def test_wait_for_ranks_with_mismatched_world_size_raises_control_error() -> None:
    async def body() -> None:
        channel, secret, session_id = new_controller()
        async with channel:
            with rank_threads(channel, 1, secret, session_id):
                await channel.wait_for_ranks(1, timeout_s=5.0)
                with pytest.raises(ControlError, match="world_size=1, but 3 ranks"):
                    await channel.wait_for_ranks(3, timeout_s=1.0)
                await channel.shutdown_ranks()

    run(body)


def test_fail_pending_aborts_wait_for_ranks_and_in_flight_broadcast() -> None:
    class RanksDied(RuntimeError):
        pass

    async def body() -> None:
        channel, secret, session_id = new_controller()
        async with channel:
            waiter = asyncio.create_task(channel.wait_for_ranks(2, timeout_s=30.0))
            await asyncio.sleep(0.1)
            channel.fail_pending(RanksDied("rank processes exited"))
            with pytest.raises(RanksDied):
                await waiter

        second, secret, session_id = new_controller()
        async with second:
            with rank_threads(second, 1, secret, session_id):
                await second.wait_for_ranks(1, timeout_s=5.0)
                in_flight = asyncio.create_task(second.broadcast("sleep", {"seconds": [0.6]}, timeout_s=30.0))
                await asyncio.sleep(0.1)
                # From another thread, as a supervisor thread would.
                await asyncio.to_thread(second.fail_pending, RanksDied("rank 0 exited with code -9"))
                started = time.monotonic()
                with pytest.raises(RanksDied):
                    await in_flight
                assert time.monotonic() - started < 0.5
                with pytest.raises(RanksDied):
                    await second.broadcast("add", {"x": 1})
                with pytest.raises(RanksDied):
                    await second.wait_for_ranks(1, timeout_s=1.0)

    run(body)


def test_close_fails_an_in_flight_broadcast_and_is_idempotent() -> None:
    async def body() -> None:
        channel, secret, session_id = new_controller()
        await channel.start()
        with rank_threads(channel, 1, secret, session_id):
            await channel.wait_for_ranks(1, timeout_s=5.0)
            in_flight = asyncio.create_task(channel.broadcast("sleep", {"seconds": [0.3]}))
            await asyncio.sleep(0.1)
            await channel.close()
            await channel.close()
            with pytest.raises(ControlError, match="closed"):
                await in_flight
            with pytest.raises(ControlError, match="closed"):
                await channel.broadcast("add", {"x": 1})

    run(body)


def test_heartbeats_report_age_current_command_and_progress_while_a_rank_works() -> None:
    async def body() -> None:
        channel, secret, session_id = new_controller()
        async with channel:
            with rank_threads(channel, 2, secret, session_id):
                await channel.wait_for_ranks(2, timeout_s=5.0)
                work = asyncio.create_task(channel.broadcast("sleep", {"seconds": [0.0, 0.8]}, timeout_s=5.0))
                await asyncio.sleep(0.5)
                during = channel.current_commands()
                progress_during = channel.command_progress()
                ages = channel.heartbeat_ages()
                assert await work == [0, 1]
                await asyncio.sleep(0.3)
                after = channel.current_commands()
                progress_after = channel.command_progress()
                await channel.shutdown_ranks()

        assert during == {0: None, 1: "sleep"}
        assert progress_during == {0: None, 1: (1, 2)}
        assert all(age < 0.5 for age in ages.values())
        assert after == {0: None, 1: None}
        assert progress_after == {0: None, 1: None}

    run(body)


def test_shutdown_ranks_makes_recv_command_return_shutdown() -> None:
    async def body() -> None:
        channel, secret, session_id = new_controller()
        async with channel:
            rank = RankChannel(0, 1, channel.address, secret, session_id, heartbeat_interval_s=0.1)
            rank.connect()
            try:
                await channel.wait_for_ranks(1, timeout_s=5.0)
                await channel.shutdown_ranks()
                command = await asyncio.to_thread(rank.recv_command, 5.0)
                nothing = await asyncio.to_thread(rank.recv_command, 0.1)
            finally:
                rank.close()

        assert command is not None and command.name == SHUTDOWN
        assert nothing is None

    run(body)


def test_rank_drops_a_replayed_command(caplog: pytest.LogCaptureFixture, tmp_path) -> None:
    caplog.set_level(logging.WARNING, logger="rlsdk.control")
    secret, session_id = new_session_secret(), "s"
    socket_dir = tmp_path / "run"
    socket_dir.mkdir(mode=0o700)
    address = f"ipc://{socket_dir}/control"
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    rank = RankChannel(0, 1, address, secret, session_id)
    try:
        rank.connect()
        hellos = [router.recv_multipart() for _ in range(2)]  # one per socket
        identity = next(frames[0] for frames in hellos if b'"stream":"cmd"' in b"".join(frames[2:-1]))
        command = protocol.encode(
            secret, sender="controller", kind="command", seq=4, rank=0, session=session_id, counter=1,
            extra={"command": "x"}, body={"a": 1},
        )  # fmt: skip
        router.send_multipart([identity, *command])
        first = rank.recv_command(timeout_s=5.0)
        router.send_multipart([identity, *command])
        replayed = rank.recv_command(timeout_s=0.3)
    finally:
        rank.close(flush_timeout_s=0.0)
        router.close()
        context.term()

    assert first is not None and (first.seq, first.name, first.body) == (4, "x", {"a": 1})
    assert replayed is None
    assert rank.dropped_messages == 1
    assert any("counter 1 is not after 1" in r.getMessage() for r in caplog.records)


def test_rank_calls_on_controller_lost_when_controller_heartbeats_stop() -> None:
    lost = threading.Event()

    async def body() -> float:
        channel, secret, session_id = new_controller(heartbeat_interval_s=0.1)
        await channel.start()
        rank = RankChannel(
            0,
            1,
            channel.address,
            secret,
            session_id,
            heartbeat_interval_s=0.1,
            heartbeat_timeout_s=0.5,
            on_controller_lost=lost.set,
        )
        rank.connect()
        try:
            await channel.wait_for_ranks(1, timeout_s=5.0)
            await asyncio.sleep(0.8)  # longer than the timeout, with healthy heartbeats
            assert not lost.is_set()
            assert rank.controller_heartbeat_age < 0.4
            await channel.close()
            stopped = time.monotonic()
            assert await asyncio.to_thread(lost.wait, 3.0)
            return time.monotonic() - stopped
        finally:
            rank.close(flush_timeout_s=0.0)

    detected_after = run(body)
    assert 0.3 < detected_after < 1.5


def test_send_log_never_blocks_and_drops_oldest_when_the_queue_is_full() -> None:
    rank = RankChannel(0, 1, "tcp://127.0.0.1:1", b"k" * 32, "s", max_queued_logs=10)
    # Not connected: nothing drains the queue, so it fills.
    started = time.monotonic()
    for index in range(25):
        rank.send_log({"message": str(index)})
    elapsed = time.monotonic() - started

    assert rank.dropped_logs == 15
    assert [rank._logs.get_nowait()["message"] for _ in range(10)] == [str(i) for i in range(15, 25)]
    assert elapsed < 0.5
    rank.close()


def test_from_env_reads_the_environment_contract() -> None:
    secret = new_session_secret()
    env = protocol.rank_environment(
        "tcp://127.0.0.1:7", secret, "sid", heartbeat_interval_s=0.25, heartbeat_timeout_s=3.0
    )

    rank = RankChannel.from_env(1, 2, environ=env)

    assert (rank.rank, rank.world_size, rank.address) == (1, 2, "tcp://127.0.0.1:7")
    assert rank._secret == secret and rank._heartbeat_interval_s == 0.25 and rank._heartbeat_timeout_s == 3.0
    with pytest.raises(ControlError, match="RLSDK_SESSION_SECRET"):
        RankChannel.from_env(0, 1, environ={"RLSDK_CONTROL_ADDR": "tcp://x:1", "RLSDK_SESSION_ID": "s"})


def test_oversized_message_from_a_peer_is_refused_by_zeromq_and_the_channel_goes_on() -> None:
    async def body() -> None:
        channel, secret, session_id = new_controller(max_message_bytes=1 << 20)
        async with channel:
            context = zmq.Context()
            try:
                # an authentic, well-formed hello, but with a 2 MiB body: over the 1 MiB frame limit
                huge = context.socket(zmq.DEALER)
                huge.setsockopt(zmq.IDENTITY, b"cmd-0")
                huge.setsockopt(zmq.LINGER, 0)
                huge.connect(channel.address)
                header, *chunks, signature = protocol.encode(
                    secret, sender="rank", kind="hello", seq=0, rank=0, session=session_id, counter=1,
                    body={"rank": 0, "pad": b"x" * (2 << 20)},
                )  # fmt: skip
                huge.send_multipart([header, b"".join(chunks), signature])  # the payload as one 2 MiB frame
                await asyncio.sleep(0.5)
                huge.close()
            finally:
                context.term()
            registered_by_huge = dict(channel.ranks)
            with rank_threads(channel, 1, secret, session_id):
                await channel.wait_for_ranks(1, timeout_s=5.0)
                result = await channel.broadcast("add", {"x": 5}, timeout_s=5.0)
                await channel.shutdown_ranks()

        assert registered_by_huge == {}  # never decoded, never registered
        assert result == [5]

    run(body)


def test_controller_rejects_a_non_positive_message_limit() -> None:
    with pytest.raises(ValueError, match="max_message_bytes"):
        new_controller(max_message_bytes=0)


def test_queries_and_heartbeats_from_two_threads_are_never_refused_as_replays() -> None:
    """The controller's loop (queries, commands) and heartbeat thread share each rank's event link: its counter
    stays in send order, so no message of an honest peer is refused as a replay."""

    async def body() -> int:
        channel, secret, session_id = new_controller()
        async with channel:
            with rank_threads(channel, 2, secret, session_id):
                await channel.wait_for_ranks(2, timeout_s=5.0)
                for _ in range(30):
                    answers = await channel.query_events(protocol.CURRENT_QUERY, timeout_s=2.0)
                    assert sorted(answers) == [0, 1]
                    await channel.broadcast("add", {"x": 1}, timeout_s=5.0)
                await channel.shutdown_ranks()
            return channel.dropped_messages

    assert run(body, timeout_s=60.0) == 0
