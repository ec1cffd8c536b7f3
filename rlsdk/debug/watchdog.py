"""Hang watchdog: while a command runs, check the ranks' collectives live; when it overruns, analyse and report.

The Session uses :class:`WatchedControllerChannel` in place of the plain channel. Its ``broadcast`` waits as
before, and meanwhile:

- **live checks** (``trace_poll_s``, default 1 s): from ``trace_poll_s`` after the command started, every
  ``trace_poll_s`` it refreshes its copy of the ranks' tracers (:class:`~rlsdk.debug.live.TraceMirror`: a cheap
  ``trace_poll`` query answered by each rank's event thread) and analyses it. A *settled* divergence (a mismatch
  at one sequence number, a collective or p2p call whose counterpart ranks finished the command, are dead, or
  are blocked for good: see :mod:`rlsdk.debug.facts`) seen on two polls in a row is confirmed with one full
  ``trace`` and handled at once, as below, whether its root cause is certain or ranked among candidates.
  Unsettled states (a straggler, ranks still computing) wait for:
- **the hang check**: every ``hang_timeout_s`` without an answer it asks each rank's event thread for its
  tracer state and thread stacks (a ``trace`` query, answered while the main thread is blocked in a
  collective), runs :func:`rlsdk.debug.analyze.analyze`, and:

- no divergence (the command is just long) or a straggler: logs it and keeps waiting;
- a desync (missing/extra collective, a mismatch, a crashed rank): writes the report under
  ``OUTPUT/traces/<time>-<command>/``, logs it, and raises :class:`CollectiveHangError` (``hang_policy="raise"``)
  or keeps waiting (``"wait"``). It never waits forever on its own account: the ranks' process-group timeout
  (``launch.pg_timeout_s``) ends a stuck collective with an error on the rank.

After a :class:`CollectiveHangError` the command is not abandoned: it stays pending as :attr:`~WatchedControllerChannel
.hung` (the ranks are still inside it), new commands are refused with an error that says so, and the user chooses:
:meth:`~WatchedControllerChannel.keep_waiting` (the Session's ``keep_waiting``; returns the command's results if
the ranks get out) or terminating the ranks (``Session.close()``). The notebook dashboard offers both as buttons.
Every full report the watchdog computes (straggler and no-divergence checks included, and every confirmed live
divergence) goes to ``on_report``, which the Session uses for its ``last_trace`` and the dashboard's tracer view.
The live polls' own reports do not (they are partial views, without stacks); :attr:`~WatchedControllerChannel
.poll_stats` counts them.

When the rank processes die during a command (:meth:`~WatchedControllerChannel.fail_pending`: a gloo size mismatch
aborts a rank, the OOM killer, ...), the ranks' crash-safe tails are analysed and a divergence found there is
added to the error as a note (and ``error.trace_report``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import signal
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlsdk.control.controller import ControllerChannel
from rlsdk.debug.analyze import TraceReport, analyze, to_flight_recorder
from rlsdk.debug.live import LiveCheck, TraceMirror
from rlsdk.debug.rank import TRACE_QUERY
from rlsdk.debug.tracer import read_tail

__all__ = [
    "CollectiveHangError",
    "HungCommand",
    "WatchedControllerChannel",
    "collect_states",
    "exit_detail",
    "save_report",
]

logger = logging.getLogger("rlsdk.debug")


class CollectiveHangError(RuntimeError):
    """A command overran its deadline and the ranks' collectives diverged.

    Attributes:
        report: the :class:`~rlsdk.debug.analyze.TraceReport` (``str(report)`` is the diagnosis).
        path: where the report was saved (``None`` when it could not be written).
    """

    def __init__(self, command: str, seconds: float, report: TraceReport, path: Path | None) -> None:
        self.report = report
        self.path = path
        where = f"; saved under {path}" if path is not None else ""
        super().__init__(
            f"command {command!r} ran {seconds:.1f} s and the ranks' collectives diverged{where}\n{report}\n"
            "The ranks stay blocked in it until launch.pg_timeout_s. Choose: `await session.keep_waiting()` to wait "
            "on (returns the command's results if the ranks get out), or `await session.close()` to terminate the "
            "ranks now."
        )


@dataclass
class HungCommand:
    """A command the watchdog reported as hung and that is still pending on the ranks.

    Attributes:
        command: the command's name.
        task: the pending broadcast (its result is the command's results, index = rank).
        report: the latest trace report of the hang.
        path: where that report was saved.
        since: ``time.monotonic()`` when the command was sent.
    """

    command: str
    task: asyncio.Future[list[Any]]
    report: TraceReport
    path: Path | None
    since: float

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.since


def exit_detail(code: int) -> str:
    """``exit code N``, naming the signal of a negative code (SIGKILL: what the kernel's OOM killer sends)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            name = signal.Signals(-code).name
            hint = ": the OOM killer, or kill -9" if name == "SIGKILL" else ""
            return f"exit code {code}, killed by {name}{hint}"
    return f"exit code {code}"


async def collect_states(
    channel: Any,
    world_size: int,
    timeout_s: float,
    *,
    tail_dir: str | os.PathLike[str] | None = None,
    exit_codes: Callable[[int], int | None] | None = None,
    gone: Callable[[int], str | None] | None = None,
) -> dict[int, dict[str, Any]]:
    """Every rank's ``trace`` answer (tracer snapshot + thread stacks). A rank that does not answer within
    ``timeout_s`` becomes a crashed-rank entry holding the records of its crash-safe tail file
    (``tail_dir/rank_N.tail``), when there is one; ``dead: True`` when its exit code (``exit_codes``) or its
    disappearance (``gone``: a description, or None) is known."""
    answers = await channel.query_events(TRACE_QUERY, timeout_s)
    states: dict[int, dict[str, Any]] = {}
    for rank in range(world_size):
        value = answers.get(rank)
        if isinstance(value, dict):
            states[rank] = value
            continue
        code = exit_codes(rank) if exit_codes is not None else None
        detail = exit_detail(code) if code is not None else (gone(rank) if gone is not None else None)
        tail = read_tail(os.path.join(tail_dir, f"rank_{rank}.tail")) if tail_dir else []
        states[rank] = {
            "rank": rank,
            "crashed": True,
            "dead": detail is not None,
            "detail": detail or f"no answer within {timeout_s:g} s",
            "records": tail,
            "command": None,
        }
    return states


def save_report(report: TraceReport, directory: Path) -> Path:
    """Write ``rank_N.json`` (state, stacks), ``flight_recorder_rank_N.json`` and ``report.txt`` under
    ``directory``; ``rlsdk trace show`` reads them back. ``directory`` and its files get the mode of its parent
    (``OUTPUT/traces``, made with ``observe.output_mode``), without write access for anyone but this user."""
    from rlsdk.runtime_dir import private_dir, private_file

    directory.parent.mkdir(parents=True, exist_ok=True)
    dir_mode = (stat.S_IMODE(os.stat(directory.parent).st_mode) & 0o755) | 0o700
    private_dir(directory, mode=dir_mode)

    def write(name: str, text: str) -> None:
        with os.fdopen(private_file(directory / name, dir_mode & 0o666), "w", encoding="utf-8") as handle:
            handle.write(text)

    for rank, state in report.states.items():
        write(f"rank_{rank}.json", json.dumps(state, default=str, indent=1))
        write(f"flight_recorder_rank_{rank}.json", json.dumps(to_flight_recorder(state)))
    write("report.txt", str(report) + "\n")
    return directory


class WatchedControllerChannel(ControllerChannel):
    """A :class:`ControllerChannel` whose ``broadcast`` runs the hang watchdog (see the module docstring).

    Args:
        hang_timeout_s: seconds before the first hang check, and between checks; ``None``: no hang check.
        hang_policy: ``"raise"`` or ``"wait"`` on a desync.
        traces_dir: where reports go (``OUTPUT/traces``); ranks' crash-safe tails are read from ``live/``.
        world_size: number of ranks.
        on_report: called (on the loop) with every report the watchdog or :meth:`trace` computes.
        trace_poll_s: seconds between live checks (the first one this long after the command starts);
            ``None``: no live checks.
    """

    def __init__(
        self,
        *args: Any,
        hang_timeout_s: float | None,
        hang_policy: str,
        traces_dir: Path,
        world_size: int,
        on_report: Callable[[TraceReport], None] | None = None,
        trace_poll_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.hang_timeout_s = hang_timeout_s
        self.hang_policy = hang_policy
        self.traces_dir = Path(traces_dir)
        self.world_size = world_size
        self.on_report = on_report
        self.trace_poll_s = trace_poll_s
        self.hung: HungCommand | None = None
        self._mirror = TraceMirror(world_size)
        self._inflight: str | None = None
        # group -> the sequence number of a reported divergence the ranks got past (see analyze's acknowledged)
        self._acknowledged: dict[str, int] = {}
        self.poll_stats = {"polls": 0, "unanswered": 0, "settled": 0, "confirmed": 0}
        """Live checks so far: ``polls`` analysed, ``unanswered`` (a rank busy past the poll's timeout),
        ``settled`` (a settled divergence on one poll) and ``confirmed`` (reported: on two polls, and the full
        trace agreed)."""

    def _report(self, report: TraceReport) -> None:
        if self.on_report is not None:
            try:
                self.on_report(report)
            except Exception:
                logger.exception("on_report callback failed (the watchdog is unaffected)")

    def _gone(self, rank: int) -> str | None:
        """How a rank's process is known to be gone (same host: its pid no longer runs), else ``None``."""
        hello = self.ranks.get(rank) or {}
        pid = hello.get("pid")
        if not isinstance(pid, int) or hello.get("hostname") != socket.gethostname():
            return None
        import psutil

        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return None
        except psutil.NoSuchProcess:
            pass
        except psutil.Error:
            return None
        return f"process {pid} is gone"

    async def trace(self, *, timeout_s: float = 2.0) -> TraceReport:
        """Every rank's tracer state and stacks, analysed (see :func:`rlsdk.debug.analyze.analyze`). Ranks that
        do not answer within ``timeout_s`` are asked once more with 3x the time before they count as crashed."""
        tails = self.traces_dir / "live"
        states = await collect_states(self, self.world_size, timeout_s, tail_dir=tails, gone=self._gone)
        if any(state.get("crashed") and not state.get("dead") for state in states.values()):
            states = await collect_states(self, self.world_size, 3 * timeout_s, tail_dir=tails, gone=self._gone)
        report = await self._analyze(states)
        self._report(report)
        return report

    async def _analyze(self, states: dict[int, dict[str, Any]]) -> TraceReport:
        acknowledged = dict(self._acknowledged)
        return await asyncio.to_thread(lambda: analyze(states, acknowledged=acknowledged))

    def _acknowledge(self, div: Any, _task: asyncio.Future[Any]) -> None:
        """The command of a reported divergence ended: the ranks are past it, compare what comes after."""
        if not any((side.get("record") or {}).get("p2p") for side in div.sides):
            self._acknowledged[div.group] = max(self._acknowledged.get(div.group, 0), int(div.seq))

    def fail_pending(self, exc: BaseException) -> None:
        """As the base class; when a command was running, a divergence found in the ranks' crash-safe tails (a
        dead rank's last collectives) is added to ``exc`` as a note and as ``exc.trace_report``."""
        if self._inflight is not None and isinstance(exc, Exception):
            try:
                self._note_tails(exc)
            except Exception:
                logger.exception("could not analyse the ranks' crash-safe tails")
        super().fail_pending(exc)

    def _note_tails(self, exc: Exception) -> None:
        tails = self.traces_dir / "live"
        states = {
            rank: {
                "rank": rank,
                "crashed": True,
                "detail": "the rank processes exited",
                "records": read_tail(os.path.join(tails, f"rank_{rank}.tail")),
                "command": None,
            }
            for rank in range(self.world_size)
        }
        report = analyze(states, acknowledged=dict(self._acknowledged))
        div = report.divergence
        if div is None or div.kind == "crashed rank":
            return
        exc.trace_report = report  # type: ignore[attr-defined]
        exc.add_note(f"The ranks' last collectives (crash-safe tails) show the cause:\n{report}")
        self._report(report)

    def _check_not_hung(self, command: str) -> None:
        hung = self.hung
        if hung is None:
            return
        if hung.task.done():
            self.hung = None
            return
        div = hung.report.divergence
        raise RuntimeError(
            f"cannot send {command!r}: command {hung.command!r} is still hung on the ranks after "
            f"{hung.seconds:.0f} s ({div.kind if div else 'no divergence'}); `await session.keep_waiting()` to "
            "wait on it, or `await session.close()` to terminate the ranks"
        )

    async def broadcast(self, command: str, body: Any = None, *, timeout_s: float | None = None) -> list[Any]:
        self._check_not_hung(command)
        if self.hang_timeout_s is None and self.trace_poll_s is None:
            return await super().broadcast(command, body, timeout_s=timeout_s)
        task = asyncio.ensure_future(super().broadcast(command, body, timeout_s=timeout_s))
        self._inflight = command
        try:
            return await self._watch(command, task, time.monotonic())
        finally:
            self._inflight = None

    async def keep_waiting(self, timeout_s: float | None = None) -> list[Any]:
        """Wait on the command the watchdog reported as hung (see :attr:`hung`), still watching it.

        Returns its results (index = rank) if the ranks get out of the hang (or raises their error, e.g. the
        process-group timeout). While waiting, a new divergence is saved and logged, never raised. Raises
        ``RuntimeError`` when no command is hung and ``TimeoutError`` after ``timeout_s`` (the command stays
        pending: wait again or close the session).
        """
        hung = self.hung
        if hung is None:
            raise RuntimeError("no command is hung: keep_waiting applies after a CollectiveHangError")
        # self.hung stays set while waiting, so new commands are still refused with a clear error
        watch = asyncio.ensure_future(self._watch(hung.command, hung.task, hung.since, hung=hung, policy="wait"))
        try:
            return await asyncio.wait_for(asyncio.shield(watch), timeout_s)
        except TimeoutError:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            raise TimeoutError(
                f"command {hung.command!r} is still hung after {hung.seconds:.0f} s; keep_waiting() again or "
                "close the session to terminate the ranks"
            ) from None
        finally:
            if hung.task.done() and self.hung is hung:
                self.hung = None

    async def _live_poll(self, check: LiveCheck, seen: set[tuple[Any, ...]]) -> TraceReport | None:
        """One live check; the full report of a divergence confirmed now (not one already in ``seen``)."""
        try:
            states = await self._mirror.poll(self, 1.0, gone=self._gone, tail_dir=self.traces_dir / "live")
        except Exception:  # the channel failed or closed: the command's own error says why
            logger.debug("live trace poll failed", exc_info=True)
            return None
        if states is None:
            self.poll_stats["unanswered"] += 1
            return None
        report = await self._analyze(states)
        self.poll_stats["polls"] += 1
        if report.divergence is not None and report.divergence.settled:
            self.poll_stats["settled"] += 1
        div = check.observe(report, states)
        if div is None or _key(div) in seen:
            return None
        dead = any(state.get("dead") for state in states.values())
        full = await self.trace(timeout_s=1.0 if dead else 2.0)  # a dead rank never answers: wait less for it
        if full.divergence is None or not full.divergence.settled or _key(full.divergence) != _key(div):
            check.reset()  # the full view disagrees: keep watching
            return None
        self.poll_stats["confirmed"] += 1
        return full

    async def _watch(
        self,
        command: str,
        task: asyncio.Future[list[Any]],
        start: float,
        *,
        hung: HungCommand | None = None,
        policy: str | None = None,
    ) -> list[Any]:
        policy = policy or self.hang_policy
        seen: set[tuple[Any, ...]] = set()
        if hung is not None and hung.report.divergence is not None:
            seen.add(_key(hung.report.divergence))  # already saved and shown
        base = time.monotonic() if hung is not None else start
        next_poll = base + self.trace_poll_s if self.trace_poll_s is not None else math.inf
        next_check = base + self.hang_timeout_s if self.hang_timeout_s is not None else math.inf
        check = LiveCheck()
        keep_task = False
        try:
            while True:
                wait = max(0.0, min(next_poll, next_check) - time.monotonic())
                done, _ = await asyncio.wait({task}, timeout=wait)
                if done:
                    return task.result()
                report: TraceReport | None = None
                if time.monotonic() >= next_poll:
                    report = await self._live_poll(check, seen)
                    assert self.trace_poll_s is not None
                    next_poll = time.monotonic() + self.trace_poll_s
                if report is None and time.monotonic() >= next_check:
                    assert self.hang_timeout_s is not None
                    report = await self.trace()
                    next_check = time.monotonic() + self.hang_timeout_s
                    div = report.divergence
                    if not task.done() and (div is None or div.kind == "straggler"):
                        logger.warning("command %r still running after %.0f s: %s", command, time.monotonic() - start,
                                       "no collective divergence" if div is None else div.message)  # fmt: skip
                        continue
                if task.done():
                    return task.result()
                if report is None or report.divergence is None:
                    continue
                div = report.divergence
                seconds = time.monotonic() - start
                key = _key(div)
                path: Path | None = None
                if key not in seen:
                    seen.add(key)
                    task.add_done_callback(functools.partial(self._acknowledge, div))
                    stamp = time.strftime("%Y%m%d-%H%M%S")
                    try:
                        path = await asyncio.to_thread(save_report, report, self.traces_dir / f"{stamp}-{command}")
                    except OSError:
                        logger.exception("could not save the trace report")
                    logger.error("command %r: the ranks' collectives diverged (after %.1f s; report %s):\n%s",
                                 command, seconds, path, report)  # fmt: skip
                if path is None and hung is not None:
                    path = hung.path
                if hung is not None:
                    hung.report, hung.path = report, path
                if policy == "raise":
                    keep_task = True
                    self.hung = HungCommand(command, task, report, path, start)
                    task.add_done_callback(_retrieve)
                    raise CollectiveHangError(command, seconds, report, path)
        finally:
            if not task.done() and not keep_task and hung is None:
                task.cancel()  # a hung command's task belongs to keep_waiting(), which re-registers it


def _key(div: Any) -> tuple[Any, ...]:
    return (div.kind, tuple(div.ranks), div.group, div.seq)


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a hung command's late outcome as seen (nobody may await it) and log it."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.warning("the hung command ended with %s: %s", type(exc).__name__, exc)
    else:
        logger.info("the hung command completed after all")
