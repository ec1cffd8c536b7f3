"""Errors raised by the control channel (both the controller and the rank end)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class ControlError(RuntimeError):
    """Base class of every error the control channel raises on purpose."""


class ProtocolError(ControlError):
    """A message could not be accepted: malformed frames or header, or a payload that does not decode.

    ``header`` holds the parsed header when the message was authentic but its payload failed to decode, so
    the receiver can still tell which command the unreadable reply belonged to; it is ``None`` otherwise.
    """

    def __init__(self, message: str, *, header: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.header = header


class PayloadError(ProtocolError):
    """An authentic message's payload is not a valid body (see ``rlsdk.control.codec``): unknown tag, disallowed
    dtype, shape that does not match its bytes, buffer out of bounds, nesting too deep, payload too large."""


class AuthenticationError(ProtocolError):
    """A message's HMAC signature is missing or does not match the session secret."""


class SessionMismatchError(ProtocolError):
    """A correctly signed message names another session id (a stale process from an earlier session)."""


class RankDisconnectedError(ControlError):
    """A command could not be sent: the rank's socket is gone (its process died); the launcher says how."""


class RankError(ControlError):
    """A rank raised while executing a command; carries the remote exception type, message and traceback."""

    def __init__(
        self,
        rank: int,
        command: str,
        seq: int,
        exc_type: str,
        message: str,
        remote_traceback: str,
    ) -> None:
        self.rank = rank
        self.command = command
        self.seq = seq
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        text = f"rank {rank} failed in command {command!r} (seq {seq}): {exc_type}: {message}"
        if remote_traceback:
            text += f"\n--- remote traceback (rank {rank}) ---\n{remote_traceback.rstrip()}"
        super().__init__(text)

    def __reduce__(self) -> tuple[type[RankError], tuple[int, str, int, str, str, str]]:
        return (
            type(self),
            (self.rank, self.command, self.seq, self.exc_type, self.message, self.remote_traceback),
        )


class RankUnresponsiveError(ControlError):
    """A rank process stopped sending heartbeats (hung in C code, stopped, swapped out, or its event thread died).

    The controller notices within ``launch.heartbeat_timeout_s``; the Session then stops every process of the run
    (the other ranks would wait for it in their next collective) and can :meth:`~rlsdk.Session.restart`.
    """

    def __init__(
        self,
        rank: int,
        pid: int | None,
        silent_s: float,
        timeout_s: float,
        command: str | None,
        last_lines: Sequence[str] = (),
    ) -> None:
        self.rank = rank
        self.pid = pid
        self.silent_s = silent_s
        self.timeout_s = timeout_s
        self.command = command
        self.last_lines = list(last_lines)
        doing = f"inside command {command!r}" if command else "idle"
        tail = "\n".join(self.last_lines[-20:]) or "(no log lines)"
        super().__init__(
            f"train rank {rank} (pid {pid}) sent no heartbeat for {silent_s:.1f} s "
            f"(launch.heartbeat_timeout_s = {timeout_s:g}); it was last {doing}. Last log lines of rank {rank}:\n"
            f"{tail}"
        )

    def __reduce__(self) -> tuple[type[RankUnresponsiveError], tuple[object, ...]]:
        return (
            type(self),
            (self.rank, self.pid, self.silent_s, self.timeout_s, self.command, self.last_lines),
        )


class CommandTimeoutError(ControlError, TimeoutError):
    """Not every rank answered a command in time; names the silent ranks and what they were last doing.

    ``heartbeat_ages`` maps each silent rank to the seconds since its last heartbeat (``None``: never seen);
    ``current_commands`` maps it to the command its last heartbeat reported (``None``: idle or unknown).
    """

    def __init__(
        self,
        command: str,
        seq: int,
        timeout_s: float,
        missing_ranks: Sequence[int],
        heartbeat_ages: Mapping[int, float | None],
        current_commands: Mapping[int, str | None],
    ) -> None:
        self.command = command
        self.seq = seq
        self.timeout_s = timeout_s
        self.missing_ranks = list(missing_ranks)
        self.heartbeat_ages = dict(heartbeat_ages)
        self.current_commands = dict(current_commands)
        parts = []
        for rank in self.missing_ranks:
            age = self.heartbeat_ages.get(rank)
            age_text = "never sent a heartbeat" if age is None else f"last heartbeat {age:.2f} s ago"
            parts.append(f"rank {rank} ({age_text}, current command {self.current_commands.get(rank)!r})")
        super().__init__(
            f"command {command!r} (seq {seq}) timed out after {timeout_s:g} s; no reply from " + "; ".join(parts)
        )

    def __reduce__(self) -> tuple[type[CommandTimeoutError], tuple[object, ...]]:
        return (
            type(self),
            (
                self.command,
                self.seq,
                self.timeout_s,
                self.missing_ranks,
                self.heartbeat_ages,
                self.current_commands,
            ),
        )
