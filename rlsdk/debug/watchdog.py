"""Hang watchdog: when a command overruns its deadline, collect every rank's trace and stacks, analyse, report.

The Session uses :class:`WatchedControllerChannel` in place of the plain channel. Its ``broadcast`` waits as
before; every ``hang_timeout_s`` without an answer it asks each rank's event thread for its tracer state and
thread stacks (a ``trace`` query, answered while the main thread is blocked in a collective), runs
:func:`rlsdk.debug.analyze.analyze`, and:

- no divergence (the command is just long) or a straggler: logs it and keeps waiting;
- a desync (missing/extra collective, a mismatch, a crashed rank): writes the report under
  ``OUTPUT/traces/<time>-<command>/``, logs it, and raises :class:`CollectiveHangError` (``hang_policy="raise"``)
  or keeps waiting (``"wait"``). It never waits forever on its own account: the ranks' process-group timeout
  (``launch.pg_timeout_s``) ends a stuck collective with an error on the rank.

After a :class:`CollectiveHangError` the command is not abandoned: it stays pending as :attr:`~WatchedControllerChannel
.hung` (the ranks are still inside it), new commands are refused with an error that says so, and the user chooses:
:meth:`~WatchedControllerChannel.keep_waiting` (the Session's ``keep_waiting``; returns the command's results if
the ranks get out) or terminating the ranks (``Session.close()``). The notebook dashboard offers both as buttons.
Every report the watchdog computes (straggler and no-divergence checks included) goes to ``on_report``, which the
Session uses for its ``last_trace`` and the dashboard's tracer view.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlsdk.control.controller import ControllerChannel
from rlsdk.debug.analyze import TraceReport, analyze, to_flight_recorder
from rlsdk.debug.rank import TRACE_QUERY
from rlsdk.debug.tracer import read_tail

__all__ = ["CollectiveHangError", "HungCommand", "WatchedControllerChannel", "collect_states", "save_report"]

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
            f"command {command!r} ran {seconds:.0f} s and the ranks' collectives diverged{where}\n{report}\n"
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


async def collect_states(
    channel: Any,
    world_size: int,
    timeout_s: float,
    *,
    tail_dir: str | os.PathLike[str] | None = None,
    exit_codes: Callable[[int], int | None] | None = None,
) -> dict[int, dict[str, Any]]:
    """Every rank's ``trace`` answer (tracer snapshot + thread stacks). A rank that does not answer within
    ``timeout_s`` becomes a crashed-rank entry holding the records of its crash-safe tail file
    (``tail_dir/rank_N.tail``), when there is one."""
    answers = await channel.query_events(TRACE_QUERY, timeout_s)
    states: dict[int, dict[str, Any]] = {}
    for rank in range(world_size):
        value = answers.get(rank)
        if isinstance(value, dict):
            states[rank] = value
            continue
        code = exit_codes(rank) if exit_codes is not None else None
        detail = f"exit code {code}" if code is not None else f"no answer within {timeout_s:g} s"
        tail = read_tail(os.path.join(tail_dir, f"rank_{rank}.tail")) if tail_dir else []
        states[rank] = {"rank": rank, "crashed": True, "detail": detail, "records": tail, "command": None}
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
        hang_timeout_s: seconds before the first check, and between checks; ``None`` turns the watchdog off.
        hang_policy: ``"raise"`` or ``"wait"`` on a desync.
        traces_dir: where reports go (``OUTPUT/traces``); ranks' crash-safe tails are read from ``live/``.
        world_size: number of ranks.
        on_report: called (on the loop) with every report the watchdog or :meth:`trace` computes.
    """

    def __init__(
        self,
        *args: Any,
        hang_timeout_s: float | None,
        hang_policy: str,
        traces_dir: Path,
        world_size: int,
        on_report: Callable[[TraceReport], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.hang_timeout_s = hang_timeout_s
        self.hang_policy = hang_policy
        self.traces_dir = Path(traces_dir)
        self.world_size = world_size
        self.on_report = on_report
        self.hung: HungCommand | None = None

    def _report(self, report: TraceReport) -> None:
        if self.on_report is not None:
            try:
                self.on_report(report)
            except Exception:
                logger.exception("on_report callback failed (the watchdog is unaffected)")

    async def trace(self, *, timeout_s: float = 2.0) -> TraceReport:
        """Every rank's tracer state and stacks, analysed (see :func:`rlsdk.debug.analyze.analyze`). Ranks that
        do not answer within ``timeout_s`` are asked once more with 3x the time before they count as crashed."""
        states = await collect_states(self, self.world_size, timeout_s, tail_dir=self.traces_dir / "live")
        if any(state.get("crashed") for state in states.values()):
            states = await collect_states(self, self.world_size, 3 * timeout_s, tail_dir=self.traces_dir / "live")
        report = await asyncio.to_thread(analyze, states)
        self._report(report)
        return report

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
        if self.hang_timeout_s is None:
            return await super().broadcast(command, body, timeout_s=timeout_s)
        task = asyncio.ensure_future(super().broadcast(command, body, timeout_s=timeout_s))
        return await self._watch(command, task, time.monotonic())

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

    async def _watch(
        self,
        command: str,
        task: asyncio.Future[list[Any]],
        start: float,
        *,
        hung: HungCommand | None = None,
        policy: str | None = None,
    ) -> list[Any]:
        assert self.hang_timeout_s is not None
        policy = policy or self.hang_policy
        seen: set[tuple[Any, ...]] = set()
        if hung is not None and hung.report.divergence is not None:
            div = hung.report.divergence
            seen.add((div.kind, tuple(div.ranks), div.group, div.seq))  # already saved and shown
        keep_task = False
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.hang_timeout_s)
                if done:
                    return task.result()
                report = await self.trace()
                if task.done():
                    return task.result()
                div = report.divergence
                seconds = time.monotonic() - start
                if div is None or div.kind == "straggler":
                    logger.warning("command %r still running after %.0f s: %s", command, seconds,
                                   "no collective divergence" if div is None else div.message)  # fmt: skip
                    continue
                key = (div.kind, tuple(div.ranks), div.group, div.seq)
                path: Path | None = None
                if key not in seen:
                    seen.add(key)
                    stamp = time.strftime("%Y%m%d-%H%M%S")
                    try:
                        path = await asyncio.to_thread(save_report, report, self.traces_dir / f"{stamp}-{command}")
                    except OSError:
                        logger.exception("could not save the trace report")
                    logger.error("command %r hangs after %.0f s (report %s):\n%s", command, seconds, path, report)
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


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a hung command's late outcome as seen (nobody may await it) and log it."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.warning("the hung command ended with %s: %s", type(exc).__name__, exc)
    else:
        logger.info("the hung command completed after all")
