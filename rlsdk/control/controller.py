"""Controller end of the control channel: one ROUTER socket, driven from the asyncio loop, that drives every rank.

Each rank connects two DEALER sockets to the ROUTER: a command socket (hello, results, errors) and an event socket
(hello, logs and heartbeats both ways). Keeping events off the command socket means a flood of log records never
delays a result, and a rank busy in a long command still heartbeats from its event thread.

Who can reach the socket, and whom the controller talks to:

- **Transport.** On one machine the ROUTER binds a Unix socket (``ipc://``) in a private (0700) runtime directory,
  so no TCP port is opened and no other user can even connect (the kernel checks the directory's permissions).
  Where TCP is needed (ranks on other machines) it binds ``tcp://host:*`` with ZeroMQ's CURVE: the session's key
  pairs (:func:`rlsdk.control.protocol.curve_keys`) encrypt the traffic, and a ZAP handler admits only the ranks'
  client key, so a peer without the session secret never finishes the handshake.
- **Routing.** A rank's sockets pick random routing ids; the controller routes to a rank only through the ids that
  completed an authenticated hello (signed with the ranks' key, naming the routing id it arrived on, never seen
  before), and reads nothing but a small hello from any other peer. ``ROUTER_HANDOVER`` is off: a peer that
  claims a connected rank's id is ignored by ZeroMQ, and a claimed id that never said hello is never routed to.
- **Every message after the hello** must carry a larger link counter than the last one (``n``, per socket and
  direction), so a captured message is refused when replayed; messages signed with the controller's key never
  pass as a rank's.

The socket is a plain (synchronous) zmq socket watched with ``loop.add_reader`` on its edge-triggered FD, and
sends use ``DONTWAIT``: the round trip then costs a few Python calls instead of ``zmq.asyncio``'s per-message
futures (benchmarks/session_overhead.py times the no-op round trip). All socket use stays on the loop thread,
except the heartbeat thread's sends, which take the socket lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from rlsdk.control import protocol
from rlsdk.control.errors import (
    CommandTimeoutError,
    ControlError,
    ProtocolError,
    RankDisconnectedError,
    RankError,
)

__all__ = ["CommandTimeoutError", "ControllerChannel", "RankError"]

logger = logging.getLogger("rlsdk.control")

# Warn about the first few dropped messages, then only every Nth: a misbehaving peer must not flood the log.
_DROP_WARN_FIRST = 20
_DROP_WARN_EVERY = 1000

STREAMS = ("cmd", "evt")
"""A rank's two sockets: commands (hello, results, errors) and events (hello, logs, heartbeats, query replies)."""

_ALLOWED_KINDS = {
    "cmd": frozenset({"result", "error"}),
    "evt": frozenset({"log", "heartbeat", "reply"}),
}
# The name of the Unix socket in the runtime directory.
_SOCKET_NAME = "control"
_ZAP_DOMAIN = "rlsdk-control"


@dataclass
class _Link:
    """One authenticated rank socket: which rank and stream, and the message counters of both directions."""

    rank: int
    stream: str
    last_in: int
    out: int = 0


class _AllowOneKey:
    """CURVE credentials provider for pyzmq's ZAP authenticator: admits exactly the session's client key."""

    def __init__(self, client_public: bytes) -> None:
        self._client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        import hmac

        return hmac.compare_digest(key, self._client_public)


def check_private_dir(path: str) -> None:
    """Raise ``ControlError`` unless ``path`` is a real directory of this user that no one else may enter.

    A Unix socket in such a directory cannot be connected to by another user, whatever the socket's own mode.
    """
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise ControlError(f"socket_dir {path!r} cannot be used: {exc}") from exc
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise ControlError(
            f"socket_dir {path!r} must be a directory owned by this user with mode 0700 (no access for group or "
            f"others; it is mode {oct(stat.S_IMODE(info.st_mode))}, uid {info.st_uid}): other users could connect "
            "to the control socket otherwise (use rlsdk.runtime_dir.SessionRuntimeDir)"
        )


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
        host: interface to bind a TCP socket on, with CURVE (ranks on other machines); ``None`` (the default) binds
            a Unix socket instead and opens no port.
        socket_dir: private (0700) directory of this user for the Unix socket, e.g. the Session's
            :class:`~rlsdk.runtime_dir.SessionRuntimeDir`; ``None`` with ``host=None`` = a fresh runtime directory
            of the channel's own, removed at :meth:`close`.
        heartbeat_interval_s: seconds between the controller's heartbeats to each rank.
        on_log: called in the event loop with each log record dict a rank ships (its ``rank`` key is set to the
            authenticated sender's rank, whatever the record says). ``None`` re-logs the record through
            ``rlsdk.control.rank``. Exceptions it raises are logged and swallowed.
        max_message_bytes: the largest frame accepted from any peer (``ZMQ_MAXMSGSIZE``; payloads travel in
            chunks of :data:`~rlsdk.control.protocol.FRAME_BYTES`); a peer sending a larger frame is disconnected
            by ZeroMQ before Python sees a byte of it.

    Raises:
        ValueError: empty ``secret`` or ``session_id``, ``heartbeat_interval_s <= 0``, ``max_message_bytes < 1``,
            or both ``host`` and ``socket_dir``.
    """

    def __init__(
        self,
        secret: bytes,
        session_id: str,
        *,
        host: str | None = None,
        socket_dir: str | os.PathLike[str] | None = None,
        heartbeat_interval_s: float = protocol.DEFAULT_HEARTBEAT_INTERVAL_S,
        on_log: Callable[[dict[str, Any]], None] | None = None,
        max_message_bytes: int = protocol.FRAME_BYTES,
    ) -> None:
        if max_message_bytes < 1:
            raise ValueError(f"max_message_bytes={max_message_bytes!r} is invalid: allowed an int >= 1")
        if not secret:
            raise ValueError("secret is empty: allowed a non-empty bytes string (use new_session_secret())")
        if not session_id:
            raise ValueError("session_id is empty: allowed a non-empty string")
        if heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s={heartbeat_interval_s!r} is invalid: allowed > 0")
        if host is not None and socket_dir is not None:
            raise ValueError("host and socket_dir are exclusive: TCP on host, or a Unix socket in socket_dir")
        self._secret = bytes(secret)
        self._session_id = session_id
        self._host = host
        self._socket_dir = None if socket_dir is None else os.fspath(socket_dir)
        self._own_runtime_dir: Any = None  # a SessionRuntimeDir made here when neither host nor socket_dir is given
        self._authenticator: Any = None
        self._max_message_bytes = int(max_message_bytes)
        self._heartbeat_interval_s = float(heartbeat_interval_s)
        self._on_log = on_log if on_log is not None else _relog_record
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self._address: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # The socket is used from the loop thread and from the heartbeat thread; zmq allows that only with a
        # full memory barrier between uses, which this lock gives. It also keeps each link's counter in the
        # order its messages leave.
        self._socket_lock = threading.Lock()
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._closed = False
        self._close_linger_ms = 0
        self._command_lock = asyncio.Lock()
        self._seq = 0
        self._heartbeat_seq = 0
        self._links: dict[bytes, _Link] = {}
        self._routes: dict[int, dict[str, bytes]] = {}
        self._seen_identities: set[bytes] = set()
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
        """Messages dropped since start: bad signature, wrong session, malformed frames, replays or a peer that
        has not said hello."""

    # ------------------------------------------------------------------ lifecycle

    @property
    def address(self) -> str:
        """The address ranks connect to: ``ipc:///RUNTIME_DIR/control`` or ``tcp://HOST:PORT``.

        Raises:
            ControlError: the channel has not been started.
        """
        if self._address is None:
            raise ControlError("ControllerChannel.address is unknown before start()")
        return self._address

    @property
    def transport(self) -> str:
        """``"ipc"`` (a Unix socket in a private directory, the default) or ``"tcp"`` (with CURVE)."""
        return "ipc" if self._host is None else "tcp"

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
        """Bind the ROUTER socket (a Unix socket, or ``tcp://host:*`` with CURVE) and start the receive and
        heartbeat tasks.

        Raises:
            ControlError: the channel was already started or closed; ``socket_dir`` is not a private directory of
                this user; TCP is asked for but this libzmq has no CURVE (the channel never listens on TCP
                without it).
            zmq.ZMQError: the socket cannot be bound.
        """
        if self._closed or self._socket is not None:
            raise ControlError("ControllerChannel.start() may be called once, before close()")
        if self._host is not None and not zmq.has("curve"):
            raise ControlError(
                f"the control channel would listen on TCP ({self._host}) but this libzmq has no CURVE "
                "(zmq.has('curve') is False): it refuses to accept unencrypted, unauthenticated TCP peers. Install "
                "a pyzmq wheel (they bundle CURVE) or run on one machine (scheduler 'local', Unix sockets)"
            )
        self._loop = asyncio.get_running_loop()
        self._context = zmq.Context()
        sock = self._context.socket(zmq.ROUTER)
        try:
            endpoint = self._bind(sock)
        except BaseException:
            sock.close(linger=0)
            self._stop_transport()
            raise
        self._address = endpoint
        self._socket = sock
        self._loop.add_reader(sock.getsockopt(zmq.FD), self._drain)
        # Heartbeats come from a thread, not the event loop: a notebook cell that blocks the kernel's loop for
        # minutes must not make the ranks believe the controller died.
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop, name="rlsdk-control-heartbeat", daemon=True
        )
        self._heartbeat_thread.start()
        logger.debug("control channel listening on %s (session %s)", self._address, self._session_id)

    def _bind(self, sock: zmq.Socket[bytes]) -> str:
        """Set the socket's options and bind it; returns the address ranks connect to."""
        assert self._context is not None
        # Sending to an id that is not connected raises EHOSTUNREACH instead of dropping silently. No
        # ROUTER_HANDOVER: a second peer claiming a connected peer's id is ignored, never given its route.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        # An oversized frame (any peer, authenticated or not, during the handshake too) drops that peer's
        # connection inside ZeroMQ: it never reaches Python, never allocates beyond the limit.
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        if self._host is None:
            if self._socket_dir is None:
                from rlsdk.runtime_dir import SessionRuntimeDir

                self._own_runtime_dir = SessionRuntimeDir()
                self._socket_dir = self._own_runtime_dir.path
            check_private_dir(self._socket_dir)
            from rlsdk.runtime_dir import socket_path

            path = socket_path(self._socket_dir, _SOCKET_NAME)
            sock.bind(f"ipc://{path}")
            return f"ipc://{path}"
        from zmq.auth.thread import ThreadAuthenticator

        keys = protocol.curve_keys(self._secret)
        self._authenticator = ThreadAuthenticator(self._context, log=logging.getLogger("rlsdk.control.zap"))
        self._authenticator.start()
        self._authenticator.configure_curve_callback(_ZAP_DOMAIN, credentials_provider=_AllowOneKey(keys.client_public))
        sock.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
        bind_host = self._host
        if ":" in bind_host and not bind_host.startswith("["):
            sock.setsockopt(zmq.IPV6, 1)
            bind_host = f"[{bind_host}]"
        sock.bind(f"tcp://{bind_host}:*")
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return f"tcp://{bind_host}:{endpoint.rsplit(':', 1)[1]}"

    def _stop_transport(self) -> None:
        if self._authenticator is not None:
            with contextlib.suppress(Exception):
                self._authenticator.stop()
            self._authenticator = None
        if self._context is not None:
            self._context.term()
            self._context = None
        if self._own_runtime_dir is not None:
            self._own_runtime_dir.remove()
            self._own_runtime_dir = None

    async def shutdown_ranks(self, *, linger_s: float = 0.5) -> None:
        """Send ``shutdown`` to every registered rank's command socket; best effort, waits for no reply.

        The messages get up to ``linger_s`` to leave the socket when the channel is closed afterwards. Ranks
        that are gone are skipped (logged at DEBUG).
        """
        if self._socket is None or self._closed:
            return
        self._seq += 1
        for rank in sorted(self._ranks):
            try:
                self._send_to(rank, "cmd", "shutdown", self._seq)
            except (zmq.ZMQError, ControlError) as exc:
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
        self._stop_transport()

    async def __aenter__(self) -> ControllerChannel:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ ranks

    async def wait_for_ranks(self, world_size: int, timeout_s: float | None) -> dict[int, dict[str, Any]]:
        """Wait until ranks ``0 .. world_size-1`` have said hello on both sockets; return their hello bodies by rank.

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
            # Ready: both sockets said hello (the event socket carries the heartbeats and queries).
            missing = [
                rank for rank in range(world_size) if rank not in self._ranks or "evt" not in self._routes.get(rank, {})
            ]
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
        extra = {"command": pending.command}
        for rank in pending.ranks:
            try:
                await self._send_when_possible(rank, "command", pending.seq, payloads[rank], extra)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                raise RankDisconnectedError(
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
                try:
                    self._send_to(rank, "evt", "query", seq, payload=payload, extra={"query": name})
                except (zmq.ZMQError, ControlError) as exc:
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
            link = self._links.get(identity)
            peer = f"rank {link.rank} ({link.stream})" if link is not None else "a peer that has not said hello"
            logger.warning(
                "control channel dropped a message from %s, routing id %s: %s (%d dropped so far)",
                peer,
                identity.hex(),
                reason,
                count,
            )

    def _send_to(
        self,
        rank: int,
        stream: str,
        kind: str,
        seq: int,
        *,
        payload: bytes | None = None,
        extra: dict[str, Any] | None = None,
        schedule_drain: bool = True,
    ) -> None:
        """Sign and send one message to ``rank``'s ``stream`` socket without blocking (``zmq.Again`` at the
        high-water mark). Only the routing id that said hello on that stream is used.

        Raises:
            ControlError: ``rank`` has no authenticated socket on ``stream``.
            zmq.ZMQError: as ``send_multipart`` (``EHOSTUNREACH``: the socket is gone).
        """
        sock, loop = self._socket, self._loop
        if sock is None or loop is None or self._closed:
            raise ControlError("the control channel is not started or is closed")
        with self._socket_lock:
            identity = self._routes.get(rank, {}).get(stream)
            link = None if identity is None else self._links.get(identity)
            if identity is None or link is None:
                raise ControlError(f"rank {rank} has no authenticated {stream} socket (no hello yet)")
            # Counter, signature and send under one lock: each link's messages leave in counter order.
            link.out += 1
            frames = protocol.encode(
                self._secret, sender="controller", kind=kind, seq=seq, rank=rank, session=self._session_id,
                counter=link.out, payload=protocol.dumps_body(None) if payload is None else payload, extra=extra,
            )  # fmt: skip
            sock.send_multipart([identity, *frames], flags=zmq.DONTWAIT)
        # A send can consume the FD's edge while a message is waiting, and the edge would not fire again.
        if schedule_drain and not self._drain_scheduled:
            self._drain_scheduled = True
            loop.call_soon(self._drain)

    async def _send_when_possible(
        self, rank: int, kind: str, seq: int, payload: bytes, extra: dict[str, Any] | None
    ) -> None:
        while True:
            try:
                self._send_to(rank, "cmd", kind, seq, payload=payload, extra=extra)
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
        link = self._links.get(identity)
        if link is None:
            self._handle_hello(identity, frames[1:])
            return
        try:
            message = protocol.decode(self._secret, frames[1:], sender="rank", session=self._session_id)
        except ProtocolError as exc:
            self._drop(identity, f"{type(exc).__name__}: {exc}")
            if exc.header is not None and link.stream == "cmd":
                self._fail_unreadable_reply(link.rank, exc)
            return
        if message.counter <= link.last_in:
            self._drop(identity, f"message counter {message.counter} is not after {link.last_in} (a replay)")
            return
        link.last_in = message.counter
        if message.rank != link.rank:
            self._drop(identity, f"header names rank {message.rank}, the socket said hello as rank {link.rank}")
            return
        if message.kind not in _ALLOWED_KINDS[link.stream]:
            self._drop(identity, f"a {message.kind!r} message is not allowed on a {link.stream} socket")
            return
        if message.kind == "result":
            self._on_reply(message.rank, message.seq, message.body, None)
        elif message.kind == "error":
            self._on_reply(message.rank, message.seq, None, self._rank_error(message))
        elif message.kind == "heartbeat":
            self._on_heartbeat(message)
        elif message.kind == "reply":
            self._on_query_reply(message)
        else:
            self._on_log_message(message)

    def _handle_hello(self, identity: bytes, frames: list[bytes]) -> None:
        """A message from a routing id that has not said hello: only a small, authentic, first-time hello that
        names this routing id registers it; nothing else from it is read (its size is checked before its
        signature is computed)."""
        size = sum(len(frame) for frame in frames)
        if len(frames) != 3 or size > protocol.HELLO_MAX_BYTES:
            self._drop(
                identity,
                f"a peer that has not said hello sent {len(frames)} frames, {size} bytes: only a hello of 3 frames "
                f"and at most {protocol.HELLO_MAX_BYTES} bytes is read from it",
            )
            return
        try:
            message = protocol.decode(self._secret, frames, sender="rank", session=self._session_id)
        except ProtocolError as exc:
            self._drop(identity, f"{type(exc).__name__}: {exc}")
            return
        body = message.body
        if message.kind != "hello":
            self._drop(identity, f"a {message.kind!r} message from a peer that has not said hello")
            return
        if (
            not isinstance(body, dict)
            or body.get("rank") != message.rank
            or body.get("stream") not in STREAMS
            or body.get("identity") != identity.hex()
        ):
            self._drop(identity, f"malformed hello body (rank, stream and this routing id expected): {body!r}")
            return
        if identity in self._seen_identities:
            self._drop(identity, "hello from a routing id that said hello before (a replay)")
            return
        self._seen_identities.add(identity)
        rank, stream = message.rank, body["stream"]
        routes = self._routes.setdefault(rank, {})
        with self._socket_lock:  # the heartbeat thread reads routes and links under it
            old = routes.get(stream)
            if old is not None:
                self._links.pop(old, None)
            routes[stream] = identity
            self._links[identity] = _Link(rank, stream, last_in=message.counter)
        if stream == "cmd":
            self._on_hello(message)
        else:
            self._wake_rank_waiters()

    def _on_hello(self, message: protocol.Message) -> None:
        body = message.body
        again = message.rank in self._ranks
        self._ranks[message.rank] = {key: value for key, value in body.items() if key not in ("stream", "identity")}
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
            record["rank"] = message.rank  # the authenticated sender; never what the record claims
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
            loop = self._loop
            if self._socket is None or loop is None or self._closed:
                return
            for rank in sorted(tuple(self._routes)):
                self._heartbeat_seq += 1
                try:
                    if self._closed:
                        return
                    # Never queue heartbeats behind a stalled peer: DONTWAIT drops this beat instead.
                    self._send_to(rank, "evt", "heartbeat", self._heartbeat_seq, schedule_drain=False)
                except ControlError:
                    continue  # the event socket has not said hello yet
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
