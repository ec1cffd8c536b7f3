"""Controller end of the control channel: one ROUTER socket, driven from the asyncio loop, that drives every rank.

Each rank connects two DEALER sockets to the ROUTER: a command socket (identity ``cmd-<rank>``: hello,
results, errors) and an event socket (identity ``evt-<rank>``: logs and heartbeats both ways). Keeping
events off the command socket means a flood of log records never delays a result, and a rank busy in a
long command still heartbeats from its event thread.

The socket is a plain (synchronous) zmq socket watched with ``loop.add_reader`` on its edge-triggered FD, and
sends use ``DONTWAIT``: the round trip then costs a few Python calls instead of ``zmq.asyncio``'s per-message
futures (measured: the no-op round trip to 2 ranks drops by a third). All socket use stays on the loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from rlsdk.control import protocol
from rlsdk.control.errors import CommandTimeoutError, ControlError, ProtocolError, RankError

__all__ = ["CommandTimeoutError", "ControllerChannel", "RankError"]

logger = logging.getLogger("rlsdk.control")

# Warn about the first few dropped messages, then only every Nth: a misbehaving peer must not flood the log.
_DROP_WARN_FIRST = 20
_DROP_WARN_EVERY = 1000

_ALLOWED_KINDS = {
    "cmd": frozenset({"hello", "result", "error"}),
    "evt": frozenset({"log", "heartbeat", "reply"}),
}


def command_identity(rank: int) -> bytes:
    """ZMQ identity of rank ``rank``'s command socket."""
    return b"cmd-%d" % rank


def event_identity(rank: int) -> bytes:
    """ZMQ identity of rank ``rank``'s event socket."""
    return b"evt-%d" % rank


def _parse_identity(identity: bytes) -> tuple[str, int] | None:
    role, _, rank_text = identity.partition(b"-")
    if role not in (b"cmd", b"evt") or not rank_text.isdigit() or len(rank_text) > 9:
        return None
    return role.decode(), int(rank_text)


@dataclass
class _PendingCommand:
    command: str
    seq: int
    ranks: tuple[int, ...]
    future: asyncio.Future[list[Any]]
    results: dict[int, Any] = field(default_factory=dict)


class ControllerChannel:
    """The controller's end of the channel: registers ranks, broadcasts commands, gathers results and events.

    Args:
        secret: the session secret (see :func:`rlsdk.control.protocol.new_session_secret`).
        session_id: the id every message of this session carries.
        host: interface to bind; the default keeps the channel on loopback.
        heartbeat_interval_s: seconds between the controller's heartbeats to each rank.
        on_log: called in the event loop with each log record dict a rank ships (its ``rank`` key is filled
            in when missing). ``None`` re-logs the record through ``rlsdk.control.rank``. Exceptions it
            raises are logged and swallowed.
        max_message_bytes: the largest frame accepted from any peer (``ZMQ_MAXMSGSIZE``); a peer sending a
            larger one is disconnected by ZeroMQ before Python sees a byte of it.

    Raises:
        ValueError: empty ``secret`` or ``session_id``, ``heartbeat_interval_s <= 0`` or
            ``max_message_bytes < 1``.
    """

    def __init__(
        self,
        secret: bytes,
        session_id: str,
        *,
        host: str = "127.0.0.1",
        heartbeat_interval_s: float = protocol.DEFAULT_HEARTBEAT_INTERVAL_S,
        on_log: Callable[[dict[str, Any]], None] | None = None,
        max_message_bytes: int = protocol.MAX_MESSAGE_BYTES,
    ) -> None:
        if max_message_bytes < 1:
            raise ValueError(f"max_message_bytes={max_message_bytes!r} is invalid: allowed an int >= 1")
        if not secret:
            raise ValueError("secret is empty: allowed a non-empty bytes string (use new_session_secret())")
        if not session_id:
            raise ValueError("session_id is empty: allowed a non-empty string")
        if heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s={heartbeat_interval_s!r} is invalid: allowed > 0")
        self._secret = bytes(secret)
        self._session_id = session_id
        self._host = host
        self._max_message_bytes = int(max_message_bytes)
        self._heartbeat_interval_s = float(heartbeat_interval_s)
        self._on_log = on_log if on_log is not None else _relog_record
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self._address: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # The socket is used from the loop thread and from the heartbeat thread; zmq allows that only with a
        # full memory barrier between uses, which this lock gives.
        self._socket_lock = threading.Lock()
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._closed = False
        self._close_linger_ms = 0
        self._command_lock = asyncio.Lock()
        self._seq = 0
        self._heartbeat_seq = 0
        self._ranks: dict[int, dict[str, Any]] = {}
        self._last_heartbeat: dict[int, float] = {}
        self._current_command: dict[int, str | None] = {}
        self._progress: dict[int, tuple[int, int] | None] = {}
        self._pending: dict[int, _PendingCommand] = {}
        self._rank_waiters: set[asyncio.Future[None]] = set()
        self._failure: BaseException | None = None
        self._drain_scheduled = False
        self._queries: dict[int, tuple[asyncio.Future[None], dict[int, Any], int]] = {}
        self._query_seq = 0
        self.dropped_messages = 0
        """Messages dropped since start: bad signature, wrong session, malformed frames or unknown peer."""

    # ------------------------------------------------------------------ lifecycle

    @property
    def address(self) -> str:
        """The address ranks connect to, e.g. ``tcp://127.0.0.1:PORT``.

        Raises:
            ControlError: the channel has not been started.
        """
        if self._address is None:
            raise ControlError("ControllerChannel.address is unknown before start()")
        return self._address

    @property
    def session_id(self) -> str:
        """The session id every message carries."""
        return self._session_id

    def rank_environment(self, *, heartbeat_timeout_s: float = protocol.DEFAULT_HEARTBEAT_TIMEOUT_S) -> dict[str, str]:
        """Environment variables for a rank process to reach this channel (see ``RankChannel.from_env``).

        Raises:
            ControlError: the channel has not been started.
            ValueError: ``heartbeat_timeout_s`` is not larger than the heartbeat interval.
        """
        return protocol.rank_environment(
            self.address,
            self._secret,
            self._session_id,
            heartbeat_interval_s=self._heartbeat_interval_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
        )

    async def start(self) -> None:
        """Bind the ROUTER socket on ``tcp://host:*`` and start the receive and heartbeat tasks.

        Raises:
            ControlError: the channel was already started or closed.
            zmq.ZMQError: the socket cannot be bound.
        """
        if self._closed or self._socket is not None:
            raise ControlError("ControllerChannel.start() may be called once, before close()")
        self._loop = asyncio.get_running_loop()
        self._context = zmq.Context()
        sock = self._context.socket(zmq.ROUTER)
        # Sending to an identity that is not connected raises EHOSTUNREACH instead of dropping silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A rank that reconnects (or a restarted rank) takes its identity over at once. Without this the ROUTER
        # rejects the new connection while the old one is not yet torn down, and the rank's hello is lost.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.LINGER, 0)
        # An oversized frame (any peer, authenticated or not) drops that peer's connection inside ZeroMQ: it
        # never reaches Python, never allocates beyond the limit, and the channel goes on.
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        bind_host = self._host
        if ":" in bind_host and not bind_host.startswith("["):
            sock.setsockopt(zmq.IPV6, 1)
            bind_host = f"[{bind_host}]"
        try:
            sock.bind(f"tcp://{bind_host}:*")
        except zmq.ZMQError:
            sock.close(linger=0)
            self._context.term()
            self._context = None
            raise
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._address = f"tcp://{bind_host}:{endpoint.rsplit(':', 1)[1]}"
        self._socket = sock
        self._loop.add_reader(sock.getsockopt(zmq.FD), self._drain)
        # Heartbeats come from a thread, not the event loop: a notebook cell that blocks the kernel's loop for
        # minutes must not make the ranks believe the controller died.
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop, name="rlsdk-control-heartbeat", daemon=True
        )
        self._heartbeat_thread.start()
        logger.debug("control channel listening on %s (session %s)", self._address, self._session_id)

    async def shutdown_ranks(self, *, linger_s: float = 0.5) -> None:
        """Send ``shutdown`` to every registered rank's command socket; best effort, waits for no reply.

        The messages get up to ``linger_s`` to leave the socket when the channel is closed afterwards. Ranks
        that are gone are skipped (logged at DEBUG).
        """
        if self._socket is None or self._closed:
            return
        self._seq += 1
        for rank in sorted(self._ranks):
            frames = protocol.encode(self._secret, kind="shutdown", seq=self._seq, rank=rank, session=self._session_id)
            try:
                self._send([command_identity(rank), *frames])
            except zmq.ZMQError as exc:
                logger.debug("shutdown not sent to rank %d: %s", rank, exc)
        self._close_linger_ms = max(self._close_linger_ms, int(linger_s * 1000))

    async def close(self) -> None:
        """Cancel the tasks, fail waiting calls with :class:`ControlError`, close the socket, end the context.

        Idempotent. Blocks for at most the ``linger_s`` of a preceding :meth:`shutdown_ranks`.
        """
        if self._closed:
            return
        self._closed = True
        self._heartbeat_stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=5.0)
            self._heartbeat_thread = None
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_waiters(ControlError("the control channel was closed"))
        if self._socket is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._socket.getsockopt(zmq.FD))
            self._socket.close(linger=self._close_linger_ms)
            self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None

    async def __aenter__(self) -> ControllerChannel:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ ranks

    async def wait_for_ranks(self, world_size: int, timeout_s: float | None) -> dict[int, dict[str, Any]]:
        """Wait until ranks ``0 .. world_size-1`` have said hello; return their hello bodies by rank.

        Raises:
            ValueError: ``world_size < 1``.
            TimeoutError: ``timeout_s`` passed first; the message names the ranks that never said hello.
            ControlError: a hello reports another world size or a rank outside ``0 .. world_size-1``; or the
                channel is not started or is closed.
            BaseException: the exception given to :meth:`fail_pending`.
        """
        if world_size < 1:
            raise ValueError(f"world_size={world_size!r} is invalid: allowed >= 1")
        self._check_usable()
        assert self._loop is not None
        deadline = None if timeout_s is None else self._loop.time() + timeout_s
        while True:
            if self._failure is not None:
                raise self._failure.with_traceback(None)
            if self._closed:
                raise ControlError("the control channel was closed")
            for rank, hello in self._ranks.items():
                if rank >= world_size or hello.get("world_size") != world_size:
                    raise ControlError(
                        f"rank {rank} said hello with world_size={hello.get('world_size')!r}, but "
                        f"{world_size} ranks are expected"
                    )
            missing = [rank for rank in range(world_size) if rank not in self._ranks]
            if not missing:
                return {rank: dict(self._ranks[rank]) for rank in range(world_size)}
            remaining = None if deadline is None else deadline - self._loop.time()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(
                    f"rank(s) {missing} of {world_size} never said hello on {self._address} within "
                    f"{timeout_s:g} s (registered: {sorted(self._ranks)}; dropped messages: "
                    f"{self.dropped_messages})"
                )
            waiter: asyncio.Future[None] = self._loop.create_future()
            self._rank_waiters.add(waiter)
            try:
                await asyncio.wait_for(waiter, remaining)
            except TimeoutError:
                pass
            finally:
                self._rank_waiters.discard(waiter)

    @property
    def ranks(self) -> dict[int, dict[str, Any]]:
        """Hello bodies of the registered ranks, by rank."""
        return {rank: dict(hello) for rank, hello in sorted(self._ranks.items())}

    def heartbeat_ages(self) -> dict[int, float]:
        """Seconds since each registered rank's last heartbeat (or its hello, before the first heartbeat)."""
        now = time.monotonic()
        return {rank: now - self._last_heartbeat[rank] for rank in sorted(self._last_heartbeat)}

    def current_commands(self) -> dict[int, str | None]:
        """The command each registered rank's last heartbeat reported running (``None``: idle)."""
        return dict(sorted(self._current_command.items()))

    def command_progress(self) -> dict[int, tuple[int, int] | None]:
        """``(done, total)`` of the current command as each rank's last heartbeat reported it (``None``: none)."""
        return dict(sorted(self._progress.items()))

    def fail_pending(self, exc: BaseException) -> None:
        """Make every current and future :meth:`wait_for_ranks` and :meth:`broadcast` raise ``exc``.

        For the launcher's supervisor, when the rank processes died. Safe to call from another thread. The
        failure is permanent: start a new channel for new ranks.
        """
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is not None and running is not loop and loop.is_running():
            loop.call_soon_threadsafe(self._set_failure, exc)
        else:
            self._set_failure(exc)

    # ------------------------------------------------------------------ commands

    async def broadcast(
        self,
        command: str,
        body: dict[str, Any] | list[dict[str, Any]] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Send ``command`` to every registered rank and return their results as a list indexed by rank.

        ``body`` goes to every rank; a list gives one body per rank (index = rank). Broadcasts are serialised,
        so ranks see commands in sequence order.

        Raises:
            RankError: a rank replied with an error; raised at once, later replies to the command are dropped.
            CommandTimeoutError: ``timeout_s`` passed before every rank replied; it names the silent ranks,
                their last heartbeat age and their current command.
            ValueError: ``body`` is a list whose length is not the number of ranks, or a body nests too deep or
                is too large to encode.
            ControlError: no ranks are registered, the registered ranks are not ``0 .. N-1``, a rank's command
                socket is not connected, the channel is not started or closed; or :class:`PayloadError` (a
                :class:`ProtocolError`) when a rank's reply does not decode.
            BaseException: the exception given to :meth:`fail_pending`.
            TypeError: a body holds a value that :mod:`rlsdk.control.codec` cannot encode (the message names
                its path).
        """
        self._check_usable()
        async with self._command_lock:
            self._check_usable()
            ranks = tuple(sorted(self._ranks))
            if not ranks:
                raise ControlError(f"cannot send {command!r}: no rank has registered (call wait_for_ranks)")
            if ranks != tuple(range(len(ranks))):
                raise ControlError(f"cannot send {command!r}: registered ranks {list(ranks)} are not 0..N-1")
            if isinstance(body, list):
                if len(body) != len(ranks):
                    raise ValueError(
                        f"body is a list of {len(body)} items for command {command!r}: allowed one body per "
                        f"rank ({len(ranks)})"
                    )
                payloads = [protocol.dumps_body(item) for item in body]
            else:
                payloads = [protocol.dumps_body(body)] * len(ranks)
            assert self._loop is not None
            self._seq += 1
            pending = _PendingCommand(command, self._seq, ranks, self._loop.create_future())
            self._pending[pending.seq] = pending
            try:
                return await asyncio.wait_for(self._send_and_gather(pending, payloads), timeout_s)
            except TimeoutError:
                assert timeout_s is not None
                missing = [rank for rank in ranks if rank not in pending.results]
                ages = self.heartbeat_ages()
                raise CommandTimeoutError(
                    command,
                    pending.seq,
                    timeout_s,
                    missing,
                    {rank: ages.get(rank) for rank in missing},
                    {rank: self._current_command.get(rank) for rank in missing},
                ) from None
            finally:
                self._pending.pop(pending.seq, None)

    async def _send_and_gather(self, pending: _PendingCommand, payloads: Sequence[bytes]) -> list[Any]:
        assert self._socket is not None
        extra = {"command": pending.command}
        for rank in pending.ranks:
            frames = protocol.encode(
                self._secret,
                kind="command",
                seq=pending.seq,
                rank=rank,
                session=self._session_id,
                extra=extra,
                payload=payloads[rank],
            )
            try:
                await self._send_when_possible([command_identity(rank), *frames])
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                raise ControlError(
                    f"cannot send {pending.command!r} (seq {pending.seq}) to rank {rank}: its command socket "
                    "is not connected (the rank process may have died)"
                ) from exc
        return await pending.future

    async def query_events(self, name: str, timeout_s: float, body: Any = None) -> dict[int, Any]:
        """Ask every registered rank's event thread for ``name`` (see ``RankChannel.set_query_handler``).

        Runs beside a pending :meth:`broadcast` (queries do not take the command lock), so it answers while
        the ranks' main threads are blocked. Returns ``{rank: value}`` for the ranks that answered within
        ``timeout_s``; a rank whose handler raised maps to a ``ControlError``; silent ranks are absent.
        """
        self._check_usable()
        assert self._loop is not None
        self._query_seq += 1
        seq = self._query_seq
        ranks = sorted(self._ranks)
        done: asyncio.Future[None] = self._loop.create_future()
        answers: dict[int, Any] = {}
        self._queries[seq] = (done, answers, len(ranks))
        try:
            payload = protocol.dumps_body(body)
            for rank in ranks:
                frames = protocol.encode(
                    self._secret, kind="query", seq=seq, rank=rank, session=self._session_id,
                    extra={"query": name}, payload=payload,
                )  # fmt: skip
                try:
                    self._send([event_identity(rank), *frames])
                except zmq.ZMQError as exc:
                    logger.debug("query %r not sent to rank %d: %s", name, rank, exc)
            if ranks:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(done), timeout_s)
        finally:
            self._queries.pop(seq, None)
        return dict(sorted(answers.items()))

    def _on_query_reply(self, message: protocol.Message) -> None:
        entry = self._queries.get(message.seq)
        if entry is None:
            return
        done, answers, expected = entry
        body = message.body if isinstance(message.body, dict) else {}
        answers[message.rank] = body.get("value") if body.get("ok") else ControlError(str(body.get("error")))
        if len(answers) >= expected and not done.done():
            done.set_result(None)

    # ------------------------------------------------------------------ internals

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise self._failure.with_traceback(None)
        if self._closed:
            raise ControlError("the control channel was closed")
        if self._socket is None:
            raise ControlError("the control channel is not started (await start() first)")

    def _set_failure(self, exc: BaseException) -> None:
        self._failure = exc
        self._fail_waiters(exc)

    def _fail_waiters(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for item in pending.values():
            if not item.future.done():
                item.future.set_exception(exc)
        self._wake_rank_waiters()

    def _wake_rank_waiters(self) -> None:
        for waiter in self._rank_waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _drop(self, identity: bytes, reason: str) -> None:
        self.dropped_messages += 1
        count = self.dropped_messages
        if count <= _DROP_WARN_FIRST or count % _DROP_WARN_EVERY == 0:
            logger.warning(
                "control channel dropped a message from peer %r: %s (%d dropped so far)",
                identity,
                reason,
                count,
            )

    def _send(self, frames: list[bytes]) -> None:
        """Send without blocking (raises ``zmq.Again`` at the high-water mark), then look for input: a send
        can consume the FD's edge while a message is waiting, and the edge would not fire again."""
        assert self._socket is not None and self._loop is not None
        with self._socket_lock:
            self._socket.send_multipart(frames, flags=zmq.DONTWAIT)
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    async def _send_when_possible(self, frames: list[bytes]) -> None:
        while True:
            try:
                self._send(frames)
                return
            except zmq.Again:
                await asyncio.sleep(0.001)  # the peer's queue is full: wait for it instead of dropping a command

    def _drain(self) -> None:
        """Handle every message waiting on the socket (the FD is edge-triggered: read until empty)."""
        self._drain_scheduled = False
        sock = self._socket
        if sock is None or self._closed:
            return
        while True:
            try:
                with self._socket_lock:
                    if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        return
                    frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                if not (self._closed or exc.errno in (zmq.ETERM, zmq.ENOTSOCK)):
                    logger.error("control channel receive failed: %s", exc)
                return
            try:
                self._handle(frames)
            except Exception:
                logger.exception("control channel failed to handle a message from peer %r", frames[0])

    def _handle(self, frames: list[bytes]) -> None:
        identity = frames[0]
        peer = _parse_identity(identity)
        if peer is None:
            self._drop(identity, "unknown peer identity")
            return
        role, identity_rank = peer
        try:
            message = protocol.decode(self._secret, frames[1:], session=self._session_id)
        except ProtocolError as exc:
            self._drop(identity, f"{type(exc).__name__}: {exc}")
            if exc.header is not None:
                self._fail_unreadable_reply(identity_rank, exc)
            return
        if message.rank != identity_rank:
            self._drop(identity, f"header names rank {message.rank}, identity names rank {identity_rank}")
            return
        if message.kind not in _ALLOWED_KINDS[role]:
            self._drop(identity, f"a {message.kind!r} message is not allowed on a {role} socket")
            return
        if message.kind == "hello":
            self._on_hello(message)
        elif message.kind == "result":
            self._on_reply(message.rank, message.seq, message.body, None)
        elif message.kind == "error":
            self._on_reply(message.rank, message.seq, None, self._rank_error(message))
        elif message.kind == "heartbeat":
            self._on_heartbeat(message)
        elif message.kind == "reply":
            self._on_query_reply(message)
        else:
            self._on_log_message(message)

    def _on_hello(self, message: protocol.Message) -> None:
        body = message.body
        if not isinstance(body, dict) or body.get("rank") != message.rank:
            self._drop(command_identity(message.rank), f"malformed hello body {body!r}")
            return
        again = message.rank in self._ranks
        self._ranks[message.rank] = dict(body)
        self._last_heartbeat[message.rank] = time.monotonic()
        self._current_command[message.rank] = None
        logger.info(
            "rank %d %s (pid %s on %s, world size %s)",
            message.rank,
            "registered again" if again else "registered",
            body.get("pid"),
            body.get("hostname"),
            body.get("world_size"),
        )
        self._wake_rank_waiters()

    def _on_heartbeat(self, message: protocol.Message) -> None:
        if message.rank not in self._ranks:
            return  # the event socket may beat before the command socket's hello lands
        body = message.body if isinstance(message.body, dict) else {}
        self._last_heartbeat[message.rank] = time.monotonic()
        self._current_command[message.rank] = body.get("command")
        progress = body.get("progress")
        valid = isinstance(progress, (list, tuple)) and len(progress) == 2 and all(isinstance(v, int) for v in progress)
        self._progress[message.rank] = (int(progress[0]), int(progress[1])) if valid else None

    def _on_log_message(self, message: protocol.Message) -> None:
        records = message.body if isinstance(message.body, list) else [message.body]
        for record in records:
            if not isinstance(record, dict):
                logger.debug("rank %d sent a log record that is not a dict: %r", message.rank, record)
                continue
            record.setdefault("rank", message.rank)
            try:
                self._on_log(record)
            except Exception:
                logger.exception("on_log callback failed for a record from rank %d", message.rank)

    def _rank_error(self, message: protocol.Message) -> RankError:
        body = message.body if isinstance(message.body, dict) else {}
        pending = self._pending.get(message.seq)
        return RankError(
            message.rank,
            pending.command if pending is not None else "?",
            message.seq,
            str(body.get("type", "UnknownError")),
            str(body.get("message", "")),
            str(body.get("traceback", "")),
        )

    def _on_reply(self, rank: int, seq: int, value: Any, error: BaseException | None) -> None:
        pending = self._pending.get(seq)
        if pending is None or pending.future.done() or rank not in pending.ranks:
            logger.debug("discarding a late or unexpected reply from rank %d for seq %d", rank, seq)
            return
        if error is not None:
            del self._pending[seq]
            pending.future.set_exception(error)
            return
        if rank in pending.results:
            logger.debug("discarding a duplicate reply from rank %d for seq %d", rank, seq)
            return
        pending.results[rank] = value
        if len(pending.results) == len(pending.ranks):
            del self._pending[seq]
            pending.future.set_result([pending.results[r] for r in pending.ranks])

    def _fail_unreadable_reply(self, rank: int, exc: ProtocolError) -> None:
        header = exc.header or {}
        if header.get("kind") in ("result", "error") and header.get("rank") == rank:
            self._on_reply(rank, int(header.get("seq", -1)), None, exc)

    def _heartbeat_loop(self) -> None:
        """Heartbeat thread: beat every interval to every registered rank, whatever the event loop is doing."""
        while not self._heartbeat_stop.wait(self._heartbeat_interval_s):
            sock, loop = self._socket, self._loop
            if sock is None or loop is None or self._closed:
                return
            for rank in sorted(tuple(self._ranks)):
                self._heartbeat_seq += 1
                frames = protocol.encode(
                    self._secret, kind="heartbeat", seq=self._heartbeat_seq, rank=rank, session=self._session_id
                )
                try:
                    with self._socket_lock:
                        if self._closed:
                            return
                        # Never queue heartbeats behind a stalled peer: drop this beat instead.
                        sock.send_multipart([event_identity(rank), *frames], flags=zmq.DONTWAIT)
                except zmq.ZMQError as exc:
                    if self._closed or exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                        return
                    logger.debug("heartbeat to rank %d not sent: %s", rank, exc)
            # The send may have consumed the FD's edge while a reply waits: let the loop look (when it runs).
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(self._drain)


_rank_logger = logging.getLogger("rlsdk.control.rank")


def _relog_record(record: dict[str, Any]) -> None:
    level = record.get("levelno")
    if not isinstance(level, int):
        level = logging.getLevelName(str(record.get("levelname", "INFO")))
        if not isinstance(level, int):
            level = logging.INFO
    _rank_logger.log(
        level,
        "[rank %s] %s: %s",
        record.get("rank"),
        record.get("name", "?"),
        record.get("message", record.get("msg", "")),
    )
