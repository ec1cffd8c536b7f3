"""The project logger: every record carries component, rank, world size and weight version.

Library code calls ``get_logger(__name__)``; nothing prints. In a rank, :func:`install_rank_logging` adds a
handler that ships records to the controller; in the controller, :class:`RankLogRouter` shows records from all
ranks on one stream and writes them per rank under ``OUTPUT/logs/``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT_LOGGER = "rlsdk"

_context_lock = threading.Lock()
_context: dict[str, Any] = {"rank": None, "world_size": None, "version": None, "role": "controller"}


class _BufferHandler(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []
        self.addFilter(ContextFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def capture_records(level: int | str) -> Iterator[list[logging.LogRecord]]:
    """Keep the project logger's records of ``level`` and above that are logged inside the block (as well as
    handling them as usual): work done before a Session's log handlers exist (its pre-start checks) hands them
    to those handlers afterwards instead of losing them. The project logger's level is lowered to ``level``
    meanwhile if it was higher (it is what the Session sets next)."""
    root = logging.getLogger(ROOT_LOGGER)
    numeric = logging.getLevelName(level) if isinstance(level, str) else level
    handler = _BufferHandler(numeric)
    previous = root.level
    if previous == logging.NOTSET or previous > numeric:
        root.setLevel(numeric)
    root.addHandler(handler)
    try:
        yield handler.records
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)


def get_logger(name: str) -> logging.Logger:
    """The project logger for module ``name`` (``rlsdk.x.y``); component = the part after ``rlsdk.``."""
    if not name.startswith(ROOT_LOGGER):
        name = f"{ROOT_LOGGER}.{name}"
    return logging.getLogger(name)


def set_log_context(**fields: Any) -> None:
    """Set process-wide fields stamped on every record (``rank``, ``world_size``, ``version``, ``role``)."""
    with _context_lock:
        _context.update(fields)


def log_context() -> dict[str, Any]:
    with _context_lock:
        return dict(_context)


def _component(logger_name: str) -> str:
    parts = logger_name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == ROOT_LOGGER else logger_name


class ContextFilter(logging.Filter):
    """Stamps ``component``, ``rank``, ``world_size``, ``version`` and ``role`` on records that lack them."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = log_context()
        if not hasattr(record, "component"):
            record.component = _component(record.name)
        for key, value in ctx.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def format_tag(record: dict[str, Any]) -> str:
    """``[rank 0/2 train v3]`` for a rank, ``[controller session v3]`` for the controller."""
    version = record.get("version")
    vtag = f" v{version}" if version is not None else ""
    rank = record.get("rank")
    if rank is None:
        return f"[{record.get('role', 'controller')} {record.get('component', '?')}{vtag}]"
    return f"[rank {rank}/{record.get('world_size', '?')} {record.get('component', '?')}{vtag}]"


def record_to_dict(record: logging.LogRecord) -> dict[str, Any]:
    """A picklable, self-describing form of a record, for shipping across processes."""
    message = record.getMessage()
    if record.exc_info and record.exc_info[0] is not None:
        message = f"{message}\n{logging.Formatter().formatException(record.exc_info)}"
    return {
        "time": record.created,
        "level": record.levelname,
        "levelno": record.levelno,
        "logger": record.name,
        "component": getattr(record, "component", _component(record.name)),
        "rank": getattr(record, "rank", None),
        "world_size": getattr(record, "world_size", None),
        "version": getattr(record, "version", None),
        "role": getattr(record, "role", None),
        "message": message,
    }


def format_record_dict(record: dict[str, Any]) -> str:
    import time

    stamp = time.strftime("%H:%M:%S", time.localtime(record["time"]))
    return f"{stamp} {record['level']:<7} {format_tag(record)} {record['message']}"


class ShippingHandler(logging.Handler):
    """Hands each record (as a dict) to ``send``; used by ranks to ship records to the controller."""

    def __init__(self, send: Callable[[dict[str, Any]], None], level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self._send = send
        self.addFilter(ContextFilter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._send(record_to_dict(record))
        except Exception:  # a broken channel must never break training
            self.handleError(record)


def install_rank_logging(
    send: Callable[[dict[str, Any]], None], *, rank: int, world_size: int, level: int
) -> ShippingHandler:
    """Route the project logger of a rank to the controller (and nowhere else)."""
    set_log_context(rank=rank, world_size=world_size, role="train")
    root = logging.getLogger(ROOT_LOGGER)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = ShippingHandler(send)
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    return handler


_ROLE_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")


def log_file_key(record: dict[str, Any]) -> str:
    """The log file (without ``.log``) a record goes to: ``rank_N`` for an int rank, else its role when that is a
    plain name (``controller``, ``launcher``, ``inference``), else ``controller``.

    A record's fields can never name a path: the control channel sets ``rank`` to the authenticated sender's, and
    anything else that is not a plain name is not used (``../`` cannot leave ``logs/``)."""
    rank = record.get("rank")
    if type(rank) is int and rank >= 0:
        return f"rank_{rank}"
    role = record.get("role")
    if rank is None and isinstance(role, str) and _ROLE_NAME.fullmatch(role):
        return role
    return "controller" if rank is None else "rank_unknown"


class RankLogRouter:
    """Controller side: shows every record on one stream and writes one file per rank/role.

    Files: ``OUTPUT/logs/controller.log``, ``rank_N.log``, ``launcher.log``, ... Records from ranks arrive
    through :meth:`handle` (called by the control channel); the controller's own records through the
    :class:`logging.Handler` returned by :meth:`controller_handler`. ``recent`` keeps the last ``keep_recent``
    records shown, so a view opened later (the notebook dashboard) starts with them.
    """

    def __init__(
        self,
        log_dir: Path,
        *,
        console: bool,
        level: int,
        stream: Any = None,
        keep_recent: int = 1000,
        dir_mode: int = 0o700,
        file_mode: int = 0o600,
    ) -> None:
        from rlsdk.runtime_dir import private_dir

        self.log_dir = log_dir
        self.level = level
        self.console = console
        self._stream = stream if stream is not None else sys.stderr
        self._files: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep_recent)
        self._file_mode = file_mode
        private_dir(log_dir, mode=dir_mode)

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Also hand every record to ``listener`` (e.g. a notebook widget)."""
        self._listeners.append(listener)

    def listeners(self) -> list[Callable[[dict[str, Any]], None]]:
        """The listeners records are handed to now (a copy), e.g. to hand them on to a restarted run's router."""
        return list(self._listeners)

    def remove_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Stop handing records to ``listener`` (no error when it is not registered)."""
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def recent_records(self) -> list[dict[str, Any]]:
        """The last ``keep_recent`` records shown, oldest first."""
        with self._lock:
            return list(self.recent)

    def _file_for(self, record: dict[str, Any]) -> Any:
        key = log_file_key(record)
        handle = self._files.get(key)
        if handle is None:
            from rlsdk.runtime_dir import private_file

            fd = private_file(os.path.join(self.log_dir, f"{key}.log"), self._file_mode, append=True)
            handle = os.fdopen(fd, "a", encoding="utf-8")
            self._files[key] = handle
        return handle

    def handle(self, record: dict[str, Any]) -> None:
        if record.get("levelno", logging.INFO) < self.level:
            return
        line = format_record_dict(record)
        with self._lock:
            handle = self._file_for(record)
            handle.write(line + "\n")
            handle.flush()
            self.recent.append(record)
            if self.console:
                self._stream.write(line + "\n")
                self._stream.flush()
        for listener in self._listeners:
            listener(record)

    def controller_handler(self) -> logging.Handler:
        router = self

        class _Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                try:
                    router.handle(record_to_dict(record))
                except Exception:
                    self.handleError(record)

        handler = _Handler(self.level)
        handler.addFilter(ContextFilter())
        return handler

    def close(self) -> None:
        with self._lock:
            for handle in self._files.values():
                handle.close()
            self._files.clear()
