"""Rank end of the control channel: a synchronous command socket plus one background event thread.

The thread that calls :meth:`RankChannel.recv_command` (the rank's main thread) owns the command socket. The
event thread owns the event socket: it ships log records queued by :meth:`RankChannel.send_log` (from any
thread), sends this rank's heartbeats (with the command it is running) and watches the controller's
heartbeats. Nothing the event thread does can block the training thread: the log queue is bounded and drops
its oldest records when full, and event-socket sends never wait. Nothing a log record holds can end the event
thread either (a batch too large for one message is split; a single record too large is truncated): its
heartbeats are what tells the controller this rank is alive.

Each socket gets a random routing id and says hello with it first (see :mod:`rlsdk.control.controller`); on a
``tcp://`` address both run CURVE with the session's client key pair and check the controller's server key, so
they only ever talk to the controller of this session.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from rlsdk.control import protocol
from rlsdk.control.errors import ControlError, ProtocolError

__all__ = ["SHUTDOWN", "Command", "RankChannel"]

logger = logging.getLogger("rlsdk.control")

SHUTDOWN = "shutdown"
"""Name of the :class:`Command` that :meth:`RankChannel.recv_command` returns on the controller's shutdown."""

_LOG_BATCH = 256  # log records per event message: one signature and one syscall for a burst of records
# A single log record's message is cut to this many characters when the record is too large to send whole.
_MAX_RECORD_CHARS = 64 << 10


@dataclass(frozen=True)
class Command:
    """One command from the controller. ``name == SHUTDOWN`` asks the rank to exit its command loop."""

    seq: int
    name: str
    body: Any = None


def _exit_on_controller_lost() -> None:
    logger.error("controller heartbeats stopped: the controller is gone; exiting this rank with status 3")
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(3)


class RankChannel:
    """One rank's end of the channel.

    Args:
        rank: this rank, ``0 <= rank < world_size``.
        world_size: number of ranks.
        address: the controller's address: ``ipc:///RUNTIME_DIR/control``, or ``tcp://HOST:PORT`` (CURVE).
        secret: the session secret.
        session_id: the session id.
        heartbeat_interval_s: seconds between this rank's heartbeats.
        heartbeat_timeout_s: seconds without a controller heartbeat before ``on_controller_lost`` is called.
        on_controller_lost: called once, on the event thread, when the controller's heartbeats stop; the
            default logs an ERROR and ends the process with ``os._exit(3)``.
        max_queued_logs: bound of the outgoing log queue; when it is full the oldest record is dropped.

    Raises:
        ValueError: a rank outside ``0 .. world_size-1``, an empty secret or session id, non-positive
            intervals, ``heartbeat_timeout_s <= heartbeat_interval_s`` or ``max_queued_logs < 1``.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        address: str,
        secret: bytes,
        session_id: str,
        *,
        heartbeat_interval_s: float = protocol.DEFAULT_HEARTBEAT_INTERVAL_S,
        heartbeat_timeout_s: float = protocol.DEFAULT_HEARTBEAT_TIMEOUT_S,
        on_controller_lost: Callable[[], None] | None = None,
        max_queued_logs: int = 10_000,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r}, world_size={world_size!r} are invalid: allowed 0 <= rank < size")
        if not secret:
            raise ValueError("secret is empty: allowed a non-empty bytes string")
        if not session_id:
            raise ValueError("session_id is empty: allowed a non-empty string")
        if heartbeat_interval_s <= 0 or heartbeat_timeout_s <= heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_interval_s={heartbeat_interval_s!r}, heartbeat_timeout_s={heartbeat_timeout_s!r} "
                "are invalid: allowed 0 < heartbeat_interval_s < heartbeat_timeout_s"
            )
        if max_queued_logs < 1:
            raise ValueError(f"max_queued_logs={max_queued_logs!r} is invalid: allowed >= 1")
        self.rank = rank
        self.world_size = world_size
        self.address = address
        self._secret = bytes(secret)
        self._session_id = session_id
        self._heartbeat_interval_s = float(heartbeat_interval_s)
        self._heartbeat_timeout_s = float(heartbeat_timeout_s)
        self._on_controller_lost = on_controller_lost or _exit_on_controller_lost
        self._logs: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=max_queued_logs)
        self._logs_lock = threading.Lock()
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._command_socket: zmq.Socket[bytes] | None = None
        self._event_socket: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_read_fd = -1
        self._wake_write_fd = -1
        self._wake_pending = False
        self._flush_deadline = 0.0
        self._closed = False
        self._current: tuple[str | None, int | None] = (None, None)
        self._progress: tuple[int, int] | None = None
        self._last_command_seq = 0
        self._event_seq = 0
        # Link counters (header ``n``): the last one sent and the last one accepted, per socket.
        self._sent_n = {"cmd": 0, "evt": 0}
        self._received_n = {"cmd": 0, "evt": 0}
        self._last_controller_heartbeat = time.monotonic()
        self._controller_lost = False
        self._unsent_logs: list[dict[str, Any]] = []
        self._query_handlers: dict[str, Callable[[Any], Any]] = {protocol.CURRENT_QUERY: self._current_command}
        self.dropped_messages = 0
        """Incoming messages dropped: bad signature, wrong session or rank, malformed or replayed."""
        self.dropped_logs = 0
        """Log records dropped: the queue was full, or they were still unsent when :meth:`close` gave up."""

    @classmethod
    def from_env(
        cls,
        rank: int,
        world_size: int,
        *,
        environ: Mapping[str, str] | None = None,
        on_controller_lost: Callable[[], None] | None = None,
        max_queued_logs: int = 10_000,
    ) -> RankChannel:
        """Build a channel from ``RLSDK_CONTROL_ADDR``, ``RLSDK_SESSION_SECRET`` (hex), ``RLSDK_SESSION_ID``
        and the optional ``RLSDK_HEARTBEAT_INTERVAL_S`` / ``RLSDK_HEARTBEAT_TIMEOUT_S``.

        Raises:
            ControlError: a required variable is missing, or a variable does not parse.
            ValueError: as the constructor.
        """
        env = os.environ if environ is None else environ
        missing = [
            name
            for name in (protocol.RLSDK_CONTROL_ADDR, protocol.RLSDK_SESSION_SECRET, protocol.RLSDK_SESSION_ID)
            if not env.get(name)
        ]
        if missing:
            raise ControlError(f"environment variable(s) {missing} not set: this process was not started by rlsdk")
        try:
            secret = bytes.fromhex(env[protocol.RLSDK_SESSION_SECRET])
        except ValueError as exc:
            raise ControlError(f"{protocol.RLSDK_SESSION_SECRET} is not a hex string") from exc
        return cls(
            rank,
            world_size,
            env[protocol.RLSDK_CONTROL_ADDR],
            secret,
            env[protocol.RLSDK_SESSION_ID],
            heartbeat_interval_s=_env_float(
                env, protocol.RLSDK_HEARTBEAT_INTERVAL_S, protocol.DEFAULT_HEARTBEAT_INTERVAL_S
            ),
            heartbeat_timeout_s=_env_float(
                env, protocol.RLSDK_HEARTBEAT_TIMEOUT_S, protocol.DEFAULT_HEARTBEAT_TIMEOUT_S
            ),
            on_controller_lost=on_controller_lost,
            max_queued_logs=max_queued_logs,
        )

    # ------------------------------------------------------------------ lifecycle

    def connect(self) -> None:
        """Connect both sockets, say hello (rank, world size, pid, hostname) and start the event thread.

        Each socket says hello first, naming its routing id (random, fresh for every connect): the controller
        routes to no other id.

        Raises:
            ControlError: already connected, or closed; or a ``tcp://`` address and a libzmq without CURVE.
            zmq.ZMQError: the address is invalid.
        """
        if self._closed or self._context is not None:
            raise ControlError("RankChannel.connect() may be called once, before close()")
        if self.address.startswith("tcp://") and not zmq.has("curve"):
            raise ControlError(f"{self.address} is a TCP address but this libzmq has no CURVE (zmq.has('curve'))")
        self._context = zmq.Context()
        hello = {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }
        self._command_socket = self._connect_dealer("cmd", hello)
        self._event_socket = self._connect_dealer("evt", hello)
        self._wake_read_fd, self._wake_write_fd = os.pipe()
        os.set_blocking(self._wake_read_fd, False)
        os.set_blocking(self._wake_write_fd, False)
        self._last_controller_heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._event_loop, name=f"rlsdk-rank{self.rank}-events", daemon=True)
        self._thread.start()

    def close(self, flush_timeout_s: float = 1.0) -> None:
        """Ship queued log records (at most ``flush_timeout_s``), stop the event thread, close the sockets.

        Idempotent. Replies and records still in the sockets get the rest of ``flush_timeout_s`` to leave.
        """
        if self._closed:
            return
        self._closed = True
        self._flush_deadline = time.monotonic() + max(0.0, flush_timeout_s)
        thread = self._thread
        if thread is not None:
            self._stop.set()
            self._wake()
            if thread is not threading.current_thread():
                thread.join(max(0.0, flush_timeout_s) + 1.0)
        linger_ms = int(max(0.0, self._flush_deadline - time.monotonic()) * 1000)
        for sock in (self._command_socket, self._event_socket):
            if sock is not None:
                sock.close(linger=linger_ms)
        self._command_socket = self._event_socket = None
        if self._context is not None:
            self._context.term()
            self._context = None
        # Under the lock: a send_log racing with close must never write into a reused descriptor number.
        with self._logs_lock:
            for fd in (self._wake_read_fd, self._wake_write_fd):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._wake_read_fd = self._wake_write_fd = -1

    def __enter__(self) -> RankChannel:
        self.connect()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ commands (command thread)

    def recv_command(self, timeout_s: float | None = None) -> Command | None:
        """Wait for the next command; ``None`` when ``timeout_s`` passes first.

        Returns ``Command(name=SHUTDOWN)`` when the controller shuts the ranks down. The command becomes this
        rank's current command (reported in heartbeats) until :meth:`send_result` or :meth:`send_error`.
        Messages that fail authentication, name another session or rank, or repeat an old sequence number are
        dropped, counted and logged at WARNING. Call from one thread only (the one that replies).

        Raises:
            ControlError: the channel is not connected.
        """
        sock = self._require_command_socket()
        if timeout_s is None:  # the hot path: block in recv itself (no poll round trip per command)
            while True:
                command = self._accept_command(sock.recv_multipart())
                if command is not None:
                    return command
        deadline = time.monotonic() + timeout_s
        while True:
            poll_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not sock.poll(poll_ms, zmq.POLLIN):
                if time.monotonic() >= deadline:
                    return None
                continue
            command = self._accept_command(sock.recv_multipart())
            if command is not None:
                return command

    def send_result(self, seq: int, value: Any) -> None:
        """Reply to command ``seq`` with ``value`` and clear the current command.

        ``value`` must be encodable by :mod:`rlsdk.control.codec` (plain values, lists, tuples, dicts, CPU
        tensors, numpy arrays). If it is not (``TypeError`` naming the offending path, or ``ValueError`` for
        too deep or too large a value), an error reply describing that is sent instead, so the controller
        never waits for a result that cannot come.

        Raises:
            ControlError: the channel is not connected.
        """
        sock = self._require_command_socket()
        try:
            frames = self._encode("result", seq, value, "cmd")
        except Exception as exc:
            logger.exception("result of command seq %d cannot be encoded; sending an error instead", seq)
            self.send_error(seq, exc)
            return
        sock.send_multipart(frames)
        self.set_current(None, None)

    def send_error(self, seq: int, exc: BaseException) -> None:
        """Reply to command ``seq`` with ``exc`` (type name, message and formatted traceback).

        Raises:
            ControlError: the channel is not connected.
        """
        sock = self._require_command_socket()
        body = {
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        }
        sock.send_multipart(self._encode("error", seq, body, "cmd"))
        self.set_current(None, None)

    def set_current(self, command: str | None, seq: int | None) -> None:
        """Set the command name and seq that this rank's heartbeats report (``None``: idle). Any thread.
        Clears the progress (see :meth:`set_progress`)."""
        self._current = (command, seq)
        self._progress = None

    def set_progress(self, done: int, total: int) -> None:
        """Report ``done`` of ``total`` units (e.g. micro-batches) of the current command in the next heartbeats;
        the Session's progress bars and dashboard read it. Any thread; costs one tuple assignment."""
        self._progress = (int(done), int(total))

    # ------------------------------------------------------------------ events (any thread)

    def send_log(self, record: Mapping[str, Any]) -> None:
        """Queue a log record (a dict of plain values) for the controller; never blocks. Any thread.

        ``rank`` is filled in when missing. When the queue is full the oldest queued record is dropped and
        counted in :attr:`dropped_logs`. Records sent after :meth:`close` are dropped.
        """
        if self._closed:
            self.dropped_logs += 1
            return
        item = dict(record)
        item.setdefault("rank", self.rank)
        with self._logs_lock:
            while True:
                try:
                    self._logs.put_nowait(item)
                    break
                except queue.Full:
                    with contextlib.suppress(queue.Empty):
                        self._logs.get_nowait()
                        self.dropped_logs += 1
            if not self._wake_pending:
                self._wake()

    @property
    def controller_heartbeat_age(self) -> float:
        """Seconds since the controller's last heartbeat (since :meth:`connect` before the first one)."""
        return time.monotonic() - self._last_controller_heartbeat

    # ------------------------------------------------------------------ internals

    def _connect_dealer(self, stream: str, hello: dict[str, Any]) -> zmq.Socket[bytes]:
        assert self._context is not None
        # A leading zero byte is reserved for ids ZeroMQ generates itself; 15 random bytes are not guessable.
        identity = b"r" + secrets.token_bytes(15)
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.FRAME_BYTES)
        if self.address.startswith("tcp://"):
            keys = protocol.curve_keys(self._secret)
            sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
        sock.connect(self.address)
        sock.send_multipart(self._encode("hello", 0, {**hello, "stream": stream, "identity": identity.hex()}, stream))
        return sock

    def _require_command_socket(self) -> zmq.Socket[bytes]:
        if self._command_socket is None:
            raise ControlError("the rank channel is not connected (call connect()) or is closed")
        return self._command_socket

    def _encode(self, kind: str, seq: int, body: Any, stream: str) -> list[Any]:
        """Sign one message for ``stream``'s socket; the link counter advances only when encoding succeeds."""
        counter = self._sent_n[stream] + 1
        frames = protocol.encode(
            self._secret, sender="rank", kind=kind, seq=seq, rank=self.rank, session=self._session_id,
            counter=counter, body=body,
        )  # fmt: skip
        self._sent_n[stream] = counter
        return frames

    def _drop(self, reason: str) -> None:
        self.dropped_messages += 1
        if self.dropped_messages <= 20 or self.dropped_messages % 1000 == 0:
            logger.warning(
                "rank %d dropped a message from the controller: %s (%d dropped so far)",
                self.rank,
                reason,
                self.dropped_messages,
            )

    def _accept_command(self, frames: list[bytes]) -> Command | None:
        try:
            message = protocol.decode(self._secret, frames, sender="controller", session=self._session_id)
        except ProtocolError as exc:
            self._drop(f"{type(exc).__name__}: {exc}")
            header = exc.header or {}
            if header.get("kind") == "command" and header.get("rank") == self.rank:
                # Authentic but unreadable: answer, or the controller waits for this command forever.
                self.send_error(int(header["seq"]), exc)
            return None
        if message.counter <= self._received_n["cmd"]:
            self._drop(f"message counter {message.counter} is not after {self._received_n['cmd']} (a replay)")
            return None
        self._received_n["cmd"] = message.counter
        if message.rank != self.rank:
            self._drop(f"message for rank {message.rank} reached rank {self.rank}")
            return None
        if message.kind not in ("command", SHUTDOWN):
            self._drop(f"a {message.kind!r} message is not allowed on the command socket")
            return None
        if message.seq <= self._last_command_seq:
            self._drop(f"seq {message.seq} is not after the last command's seq {self._last_command_seq}")
            return None
        self._last_command_seq = message.seq
        if message.kind == SHUTDOWN:
            return Command(message.seq, SHUTDOWN, None)
        name = message.header.get("command")
        if not isinstance(name, str):
            self._drop(f"command message seq {message.seq} has no command name")
            return None
        self.set_current(name, message.seq)
        return Command(message.seq, name, message.body)

    def _wake(self) -> None:
        self._wake_pending = True
        if self._wake_write_fd < 0:
            return  # not connected yet: the event thread drains the queue once it starts
        with contextlib.suppress(OSError):  # a full pipe means a wake-up is already pending
            os.write(self._wake_write_fd, b"\0")

    def _event_loop(self) -> None:
        sock = self._event_socket
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_read_fd, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    current, progress = self._current, self._progress
                    self._send_event("heartbeat", {"command": current[0], "seq": current[1], "progress": progress})
                    next_beat = now + self._heartbeat_interval_s
                self._check_controller(now)
                if self._stop.is_set():
                    break  # on_controller_lost closed the channel
                events = dict(poller.poll(max(0, int((next_beat - time.monotonic()) * 1000)) + 1))
                if sock in events:
                    self._receive_events(sock)
                if self._wake_read_fd in events:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_read_fd, 4096)
                self._wake_pending = False
                try:
                    self._ship_logs(None)
                except Exception:  # never let a log record stop the heartbeats (they say this rank is alive)
                    self.dropped_logs += len(self._unsent_logs)
                    self._unsent_logs = []
            if self._event_socket is not None:
                self._ship_logs(self._flush_deadline)
        except Exception:
            logger.exception("rank %d event thread failed; logs and heartbeats stop", self.rank)

    def _check_controller(self, now: float) -> None:
        if self._controller_lost or now - self._last_controller_heartbeat <= self._heartbeat_timeout_s:
            return
        self._controller_lost = True
        try:
            self._on_controller_lost()
        except Exception:
            logger.exception("rank %d: on_controller_lost callback failed", self.rank)

    def _receive_events(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = protocol.decode(self._secret, frames, sender="controller", session=self._session_id)
            except ProtocolError as exc:
                self._drop(f"{type(exc).__name__}: {exc}")
                continue
            if message.counter <= self._received_n["evt"]:
                self._drop(f"message counter {message.counter} is not after {self._received_n['evt']} (a replay)")
                continue
            self._received_n["evt"] = message.counter
            if message.kind == "query" and message.rank == self.rank:
                self._answer_query(message)
                continue
            if message.kind != "heartbeat" or message.rank != self.rank:
                self._drop(f"unexpected {message.kind!r} message for rank {message.rank} on the event socket")
                continue
            self._last_controller_heartbeat = time.monotonic()

    def _current_command(self, _body: Any) -> dict[str, Any]:
        command, seq = self._current
        # "received": the last command this rank accepted, so an idle answer from a rank the newest command has
        # not reached yet is not mistaken for one that has left it.
        return {"command": command, "seq": seq, "received": self._last_command_seq}

    def set_query_handler(self, name: str, handler: Callable[[Any], Any]) -> None:
        """Answer the controller's ``query`` messages named ``name`` with ``handler(body)`` (encodable by
        :mod:`rlsdk.control.codec`; a value that is not becomes an error answer).

        The handler runs on the event thread, so it answers while the main thread is blocked (in a collective,
        say); it must be quick and must not take locks the main thread may hold.
        """
        self._query_handlers[name] = handler

    def _answer_query(self, message: protocol.Message) -> None:
        name = message.header.get("query")
        handler = self._query_handlers.get(name) if isinstance(name, str) else None
        try:
            if handler is None:
                raise KeyError(f"no handler for query {name!r} on rank {self.rank}")
            body: Any = {"ok": True, "value": handler(message.body)}
        except Exception as exc:
            body = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        try:
            frames = self._encode("reply", message.seq, body, "evt")
        except (TypeError, ValueError) as exc:  # an unencodable answer must not end the event thread
            error = f"answer to query {name!r} cannot be encoded: {type(exc).__name__}: {exc}"
            frames = self._encode("reply", message.seq, {"ok": False, "error": error}, "evt")
        sock = self._event_socket
        if sock is not None:
            with contextlib.suppress(zmq.Again):
                sock.send_multipart(frames, zmq.NOBLOCK)

    def _ship_logs(self, deadline: float | None) -> None:
        """Send queued records in batches until the queue is empty or the event socket is full.

        Records the socket refuses are kept for the next call. With a ``deadline`` (closing), a full socket is
        retried until the deadline; what is still unsent then is dropped and counted.
        """
        while True:
            if not self._unsent_logs:
                with contextlib.suppress(queue.Empty):
                    while len(self._unsent_logs) < _LOG_BATCH:
                        self._unsent_logs.append(self._logs.get_nowait())
                if not self._unsent_logs:
                    return
            frames, count = self._log_frames()
            if frames is None or self._send_frames(frames):
                del self._unsent_logs[:count]
                continue
            if deadline is None:
                return
            if time.monotonic() >= deadline:
                self.dropped_logs += len(self._unsent_logs) + self._logs.qsize()
                self._unsent_logs = []
                return
            time.sleep(0.005)  # the socket is full while closing: give the I/O thread a moment

    def _log_frames(self) -> tuple[list[Any] | None, int]:
        """The frames of the longest prefix of the unsent records that fits in one message, and its length.

        Values the codec refuses are sent as their ``repr``; a batch over the size limits is halved; a single
        record still too large is sent with its text cut to ``_MAX_RECORD_CHARS``, or dropped and counted
        (``(None, 1)``) when even that does not fit. Never raises for anything a record holds.
        """
        batch = self._unsent_logs
        count = len(batch)
        plain = False
        while True:
            records = batch[:count]
            try:
                return self._encode("log", 0, [_plain_record(r) for r in records] if plain else records, "evt"), count
            except TypeError:
                if plain:
                    break
                plain = True
            except ValueError:
                if count == 1:
                    break
                count //= 2
        try:
            return self._encode("log", 0, [_truncated_record(batch[0])], "evt"), 1
        except (TypeError, ValueError):
            self.dropped_logs += 1
            return None, 1

    def _send_frames(self, frames: list[Any]) -> bool:
        sock = self._event_socket
        if sock is None:
            return False
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _send_event(self, kind: str, body: Any) -> bool:
        if self._event_socket is None:
            return False
        self._event_seq += 1
        return self._send_frames(self._encode(kind, self._event_seq, body, "evt"))


def _plain_record(record: dict[str, Any]) -> dict[str, Any]:
    plain = (str, int, float, bool, type(None))
    return {str(key): value if isinstance(value, plain) else repr(value) for key, value in record.items()}


def _truncated_record(record: dict[str, Any]) -> dict[str, Any]:
    """The record's standard fields, its text cut to ``_MAX_RECORD_CHARS``; says so in the text."""
    keep = ("name", "levelno", "levelname", "component", "rank", "world_size", "version", "role", "created")
    out = {key: record[key] for key in keep if isinstance(record.get(key), (str, int, float, bool))}
    text = str(record.get("message", record.get("msg", "")))
    size = len(text)
    out["message"] = text[:_MAX_RECORD_CHARS] + f" ... [rlsdk: record of {size} characters cut to fit the channel]"
    return out


def _env_float(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name)
    if not text:
        return default
    try:
        return float(text)
    except ValueError as exc:
        raise ControlError(f"{name}={text!r} is not a number of seconds") from exc
