"""Attacks on the control channel (docs/security.md), each run as the attacker would, against real sockets.

The attacker knows the protocol (this source) but not the session secret. Each test states what it proves; each
fails against the channel before issue 19 (ROUTER_HANDOVER, identities ``cmd-N``/``evt-N``, one key for both
directions, no link counters, 1 GiB frames, TCP on loopback).
"""

from __future__ import annotations

import asyncio
import encodings.idna  # noqa: F401 - loaded before the fork: the child runs as nobody
import os
import socket
import struct
import threading
import time
from typing import Any

import pytest
import zmq
from _control_helpers import new_controller, rank_threads, run

from rlsdk.control import RankChannel, protocol
from rlsdk.control import rank as rank_module

pytestmark = pytest.mark.security

NOBODY = 65534


def _rank_identities(channel: Any, rank: RankChannel) -> set[bytes]:
    """Every routing id an attacker could claim for ``rank``: the well-known names of the old protocol, and the
    rank's real ids (as if they had leaked)."""
    ids = {b"cmd-%d" % rank.rank, b"evt-%d" % rank.rank}
    for sock in (rank._command_socket, rank._event_socket):
        if sock is not None:
            ids.add(sock.getsockopt(zmq.IDENTITY))
    return ids


def test_peer_claiming_a_ranks_routing_ids_receives_no_command_and_the_rank_keeps_working() -> None:
    async def body() -> dict[str, Any]:
        channel, secret, session_id = new_controller()
        async with channel:
            with rank_threads(channel, 1, secret, session_id) as ranks:
                await channel.wait_for_ranks(1, timeout_s=5.0)
                await asyncio.sleep(0.3)  # both sockets said hello
                context = zmq.Context()
                attackers = []
                try:
                    for identity in _rank_identities(channel, ranks[0]):
                        sock = context.socket(zmq.DEALER)
                        sock.setsockopt(zmq.IDENTITY, identity)
                        sock.setsockopt(zmq.LINGER, 0)
                        sock.connect(channel.address)
                        sock.send_multipart([b"hi"])  # what a takeover sends to get the route
                        attackers.append(sock)
                    await asyncio.sleep(0.5)
                    result = await channel.broadcast("echo", {"api_key": "s3cret"}, timeout_s=5.0)
                    await asyncio.sleep(1.0)  # heartbeats keep flowing to the real rank
                    stolen = []
                    for sock in attackers:
                        while sock.poll(0):
                            stolen.append(sock.recv_multipart())
                    ages = channel.heartbeat_ages()
                    rank_age = ranks[0].controller_heartbeat_age
                finally:
                    for sock in attackers:
                        sock.close()
                    context.term()
                await channel.shutdown_ranks()
        return {"result": result, "stolen": stolen, "ages": ages, "rank_age": rank_age}

    out = run(body, timeout_s=30.0)

    assert out["stolen"] == []
    assert out["result"] == [{"rank": 0, "body": {"api_key": "s3cret"}}]
    assert out["ages"][0] < 1.0 and out["rank_age"] < 1.0


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another local user needs root (setuid to nobody)")
def test_another_local_user_cannot_connect_to_the_control_socket() -> None:
    def connect_as_nobody(address: str) -> str:
        """Fork, drop to uid nobody, connect to ``address`` with a plain socket; returns the outcome."""
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            outcome = b"?"
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                if address.startswith("ipc://"):
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.connect(address[len("ipc://") :])
                else:  # numeric addresses only: the child cannot import codecs as nobody (/root is private)
                    host, port = address[len("tcp://") :].rsplit(":", 1)
                    family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
                    sock = socket.socket(family, socket.SOCK_STREAM)
                    sock.settimeout(2.0)
                    sock.connect((host.strip("[]"), int(port)))
                sock.close()
                outcome = b"connected"
            except Exception as exc:
                outcome = type(exc).__name__.encode()
            finally:
                os.write(write_fd, outcome)
                os._exit(0)
        os.close(write_fd)
        os.waitpid(pid, 0)
        with os.fdopen(read_fd, "rb") as pipe:
            return pipe.read().decode()

    async def body() -> str:
        channel, _, _ = new_controller()
        async with channel:
            return await asyncio.to_thread(connect_as_nobody, channel.address)

    assert run(body) == "PermissionError"


def _capture(monkeypatch: pytest.MonkeyPatch, function: str, kind: str) -> list[list[bytes]]:
    """Record the frames of every ``kind`` message the rank's event thread encodes or decodes: what someone
    reading the wire (root, or the same user) captures."""
    captured: list[list[bytes]] = []
    original = getattr(protocol, function)

    def spy(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        frames = result if function == "encode" else args[1]
        if threading.current_thread().name.startswith("rlsdk-rank") and _kind_of(frames) == kind:
            captured.append([bytes(frame) for frame in frames])
        return result

    monkeypatch.setattr(rank_module.protocol, function, spy)
    return captured


def _kind_of(frames: Any) -> str | None:
    import json

    try:
        return json.loads(bytes(frames[0])).get("kind")
    except (ValueError, AttributeError, IndexError):
        return None


@pytest.mark.parametrize("captured_from", ["controller", "rank"])
def test_captured_heartbeat_replayed_after_the_rank_died_does_not_keep_it_alive(
    monkeypatch: pytest.MonkeyPatch, captured_from: str
) -> None:
    """A controller heartbeat replayed as the rank's (one key for both directions), or the rank's own heartbeat
    replayed (no counter), would make a dead rank look alive."""
    captured = _capture(monkeypatch, "decode" if captured_from == "controller" else "encode", "heartbeat")

    async def body() -> tuple[float, int]:
        channel, secret, session_id = new_controller()
        async with channel:
            rank = RankChannel(0, 1, channel.address, secret, session_id, heartbeat_interval_s=0.1)
            rank.connect()
            await channel.wait_for_ranks(1, timeout_s=5.0)
            await asyncio.sleep(0.6)
            identity = rank._event_socket.getsockopt(zmq.IDENTITY)
            rank.close(flush_timeout_s=0.0)  # the rank dies
            await asyncio.sleep(0.3)
            replayed = list(captured)
            assert replayed, "nothing captured"
            context = zmq.Context()
            replay = context.socket(zmq.DEALER)
            replay.setsockopt(zmq.IDENTITY, identity)  # its id is free again: the attacker takes it
            replay.setsockopt(zmq.LINGER, 0)
            replay.connect(channel.address)
            try:
                for _ in range(20):
                    for frames in replayed:
                        replay.send_multipart(frames)
                    await asyncio.sleep(0.1)
                age = channel.heartbeat_ages()[0]
            finally:
                replay.close()
                context.term()
            return age, channel.dropped_messages

    age, dropped = run(body, timeout_s=30.0)

    assert age > 1.5  # nothing refreshed the dead rank's heartbeat
    assert dropped >= 20


@pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE; the TCP channel refuses to start")
def test_unauthenticated_tcp_peer_cannot_make_the_controller_buffer_a_large_frame() -> None:
    """Before it knows who a peer is, the controller holds at most one small frame of it (the frame cap applies
    during the handshake, where ZeroMQ buffers a whole declared frame)."""
    declared, streamed = 512 << 20, 64 << 20

    def rss_mib() -> float:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def attack(address: str) -> tuple[float, int]:
        host, port = address[len("tcp://") :].rsplit(":", 1)
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=5.0)
        before = rss_mib()
        sent = 0
        try:
            # ZMTP 3: signature and major version first; the server then sends its whole greeting, which names
            # its security mechanism; answer with the same one, as a client would.
            sock.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3]))
            greeting = b""
            while len(greeting) < 64:
                greeting += sock.recv(64 - len(greeting))
            mechanism = greeting[12:32].rstrip(b"\0")
            sock.sendall(b"\0" + mechanism.ljust(20, b"\0") + b"\0" * 32)
            if mechanism == b"NULL":  # an open channel: become a DEALER, then send one huge message frame
                ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
                sock.sendall(bytes([0x04, len(ready)]) + ready)
                flags = 0x02
            else:  # CURVE: a huge frame in place of the 200-byte HELLO command
                flags = 0x06
            sock.sendall(bytes([flags]) + struct.pack(">Q", declared))
            chunk = b"\0" * (1 << 20)
            for _ in range(streamed >> 20):
                sock.sendall(chunk)
                sent += 1
        except OSError:
            pass  # disconnected by the receiver: what should happen
        time.sleep(0.3)
        grown = rss_mib() - before
        sock.close()
        return grown, sent

    async def body() -> tuple[float, int]:
        channel, _, _ = new_controller(host="127.0.0.1")
        async with channel:
            return await asyncio.to_thread(attack, channel.address)

    grown, sent_mib = run(body, timeout_s=60.0)

    assert grown < 16, f"the controller buffered {grown:.0f} MiB for a peer that never authenticated"
    assert sent_mib < 32


def test_rank_event_thread_survives_log_records_that_cannot_be_sent_whole() -> None:
    """A log record the codec cannot encode as is (an int too long for text), one too large for a message, and a
    batch too large together must not end the event thread: heartbeats and the other records go on."""
    received: list[dict[str, Any]] = []

    async def body() -> tuple[dict[int, float], float]:
        channel, secret, session_id = new_controller(on_log=received.append)
        async with channel:
            with rank_threads(channel, 1, secret, session_id) as ranks:
                await channel.wait_for_ranks(1, timeout_s=5.0)
                rank = ranks[0]
                rank.send_log({"name": "t", "levelno": 20, "message": "huge int", "n": 10**5000})
                rank.send_log({"name": "t", "levelno": 20, "message": "x" * (12 << 20)})
                for index in range(300):
                    rank.send_log({"name": "t", "levelno": 20, "message": f"{index}:" + "y" * (40 << 10)})
                rank.send_log({"name": "t", "levelno": 20, "message": "last"})
                deadline = time.monotonic() + 15.0
                while not any(r.get("message") == "last" for r in received) and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.0)
                ages = channel.heartbeat_ages()
                await channel.shutdown_ranks()
        return ages, time.monotonic()

    ages, _ = run(body, timeout_s=60.0)

    messages = [str(r.get("message")) for r in received]
    assert ages[0] < 1.0  # the event thread still beats
    assert messages[-1] == "last"
    assert sum(1 for m in messages if m.split(":", 1)[0].isdigit()) == 300
    assert any(m.startswith("huge int") for m in messages)
    assert any(m.startswith("xxxx") and "cut to fit the channel" in m for m in messages)


def test_log_record_cannot_choose_its_file_outside_logs(tmp_path: Any) -> None:
    """The log file a rank's record lands in comes from the authenticated sender, not from the record."""
    from rlsdk.observe.logging import RankLogRouter

    router = RankLogRouter(tmp_path / "out" / "logs", console=False, level=0)

    async def body() -> None:
        channel, secret, session_id = new_controller(on_log=router.handle)
        async with channel:
            with rank_threads(channel, 1, secret, session_id) as ranks:
                await channel.wait_for_ranks(1, timeout_s=5.0)
                record = {"name": "t", "levelno": 30, "level": "WARNING", "time": time.time(), "component": "t"}
                ranks[0].send_log({**record, "message": "via role", "rank": None, "role": "../escape"})
                ranks[0].send_log({**record, "message": "via rank", "rank": "../../escape"})
                await asyncio.sleep(1.0)
                await channel.shutdown_ranks()

    try:
        run(body)
    finally:
        router.close()

    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["out/logs/rank_0.log"]
    text = (tmp_path / "out" / "logs" / "rank_0.log").read_text()
    assert "via role" in text and "via rank" in text


@pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE; the TCP channel refuses to start")
def test_tcp_peer_without_the_session_key_gets_no_message_to_the_controller() -> None:
    """On TCP, a peer that lacks the ranks' CURVE key (plain, or with a key pair of its own even knowing the
    server's public key) never completes the handshake: not one of its frames reaches the controller."""

    async def body() -> tuple[int, dict[int, dict[str, Any]]]:
        channel, secret, session_id = new_controller(host="127.0.0.1")
        async with channel:
            context = zmq.Context()
            plain, curved = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
            socks = [plain, curved]
            try:
                public, own_secret = zmq.curve_keypair()
                server_public = protocol.curve_keys(secret).server_public if hasattr(protocol, "curve_keys") else None
                if server_public is not None:  # as if the server's public key had leaked
                    curved.setsockopt(zmq.CURVE_SERVERKEY, server_public)
                    curved.setsockopt(zmq.CURVE_PUBLICKEY, public)
                    curved.setsockopt(zmq.CURVE_SECRETKEY, own_secret)
                for sock in socks:
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.IDENTITY, b"cmd-0")
                    sock.connect(channel.address)
                    sock.send_multipart([b"{}", b"", b"\0" * 32])
                await asyncio.sleep(1.0)
            finally:
                for sock in socks:
                    sock.close()
                context.term()
            with rank_threads(channel, 1, secret, session_id):  # the ranks, with the key, still get in
                await channel.wait_for_ranks(1, timeout_s=10.0)
                assert await channel.broadcast("add", {"x": 2}, timeout_s=5.0) == [2]
                await channel.shutdown_ranks()
            return channel.dropped_messages, channel.ranks

    dropped, ranks = run(body, timeout_s=30.0)

    assert dropped == 0
    assert list(ranks) == [0]
