"""Live checks of a running command: a cheap mirror of the ranks' tracers and the two-poll confirmation rule.

While a rank command runs, the watchdog (:mod:`rlsdk.debug.watchdog`) polls the ranks about once a second.
A full ``trace`` answer (every record as a dict, every thread's stack) costs a rank tens of milliseconds to build
and encode, too much to ask every second. :class:`TraceMirror` instead keeps the controller's own copy of each
rank's recent records and asks (``trace_poll``, answered by the rank's event thread while its main thread may be
blocked in a collective) only for the records appended since the last poll and for the completion of the ones
it still holds as pending: in a blocked job a poll moves a few hundred bytes.

:class:`LiveCheck` applies the rule for reporting without waiting for ``launch.hang_timeout_s``: the same
*settled* divergence (no future action of any rank can resolve it; see :mod:`rlsdk.debug.facts`) on two polls in a
row, with the states of the blocked ranks it rests on unchanged in between. Whether its root cause is certain or
only the best of ranked candidates does not delay the report: a settled hang stays a hang.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from rlsdk.debug.analyze import Divergence, TraceReport
from rlsdk.debug.facts import fingerprint
from rlsdk.debug.rank import TRACE_POLL_QUERY
from rlsdk.debug.tracer import FIELDS, read_tail

__all__ = ["LiveCheck", "TraceMirror"]

_INDEX = FIELDS.index("index")
_MAX_PENDING = 256  # pending records whose completion one poll asks about (the newest)


class TraceMirror:
    """The controller's copy of each rank's newest records (at most ``keep`` per rank), refreshed by :meth:`poll`.

    Args:
        world_size: ranks ``0 .. world_size-1``.
        keep: records kept per rank, >= 1. The analysis compares the window every rank still holds.
    """

    def __init__(self, world_size: int, *, keep: int = 1024) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep!r} is invalid: allowed >= 1")
        self.world_size = world_size
        self.keep = keep
        self._records: dict[int, deque[dict[str, Any]]] = {rank: deque(maxlen=keep) for rank in range(world_size)}
        self._pending: dict[int, dict[int, dict[str, Any]]] = {rank: {} for rank in range(world_size)}
        self._next: dict[int, int | None] = dict.fromkeys(range(world_size))
        self._complete: dict[int, bool] = dict.fromkeys(range(world_size), True)
        self.polls = 0

    def _body(self) -> dict[str, Any]:
        since = {str(rank): index for rank, index in self._next.items() if index is not None}
        pending = {str(rank): sorted(table)[-_MAX_PENDING:] for rank, table in self._pending.items() if table}
        return {"since": since, "pending": pending}

    async def poll(
        self,
        channel: Any,
        timeout_s: float,
        *,
        gone: Callable[[int], str | None] | None = None,
        tail_dir: str | os.PathLike[str] | None = None,
    ) -> dict[int, dict[str, Any]] | None:
        """Ask every rank for what changed and return every rank's state for :func:`~rlsdk.debug.analyze.analyze`;
        ``None`` when a live rank did not answer within ``timeout_s`` (busy: ask again next time). ``gone(rank)``
        describes a rank whose process is known to have exited: its entry becomes a dead crashed rank holding the
        mirrored records and the newer ones of its crash-safe tail (``tail_dir/rank_N.tail``)."""
        answers = await channel.query_events(TRACE_POLL_QUERY, timeout_s, self._body())
        self.polls += 1
        states: dict[int, dict[str, Any]] = {}
        for rank in range(self.world_size):
            answer = answers.get(rank)
            if isinstance(answer, dict):
                states[rank] = self._merge(rank, answer)
                continue
            detail = gone(rank) if gone is not None else None
            if detail is None:
                return None
            mirrored = [dict(rec) for rec in self._records[rank]]
            last = mirrored[-1]["index"] if mirrored else -1
            tail = read_tail(os.path.join(tail_dir, f"rank_{rank}.tail")) if tail_dir is not None else []
            states[rank] = {
                "rank": rank,
                "crashed": True,
                "dead": True,
                "detail": detail,
                "records": mirrored
                + [rec for rec in tail if isinstance(rec.get("index"), int) and rec["index"] > last],
                "command": None,
            }
        return states

    def _merge(self, rank: int, answer: dict[str, Any]) -> dict[str, Any]:
        records, pending = self._records[rank], self._pending[rank]
        for index, t_end, root in answer.get("done") or ():
            rec = pending.pop(index, None)
            if rec is not None:
                rec["t_end"], rec["root"] = t_end, root
        for index, site in answer.get("sites") or ():  # a Flight Recorder rank placed a pending call later
            rec = pending.get(index)
            if rec is not None and rec.get("site") in (None, "?"):
                rec["site"] = site
        fresh = [row for row in answer.get("records") or () if isinstance(row, list) and len(row) == len(FIELDS)]
        expected = self._next[rank]
        if fresh and expected is not None and fresh[0][_INDEX] > expected:
            # records in between were not sent (more than one poll's worth): keep a contiguous window
            records.clear()
            pending.clear()
            self._complete[rank] = False
        elif expected is None and fresh and fresh[0][_INDEX] > 0:
            self._complete[rank] = False
        for row in fresh:
            if expected is not None and row[_INDEX] < expected:
                continue
            rec = dict(zip(FIELDS, row, strict=True))
            if len(records) == records.maxlen:
                old = records[0]
                pending.pop(old["index"], None)
                self._complete[rank] = False
            records.append(rec)
            if rec["t_end"] is None:
                pending[rec["index"]] = rec
        if fresh:
            self._next[rank] = fresh[-1][_INDEX] + 1
        elif expected is None:
            self._next[rank] = int(answer.get("count") or 0)
        state = {key: value for key, value in answer.items() if key not in ("records", "done", "sites")}
        state["records"] = [dict(rec) for rec in records]  # a snapshot: later polls update the mirror's copies
        state["truncated"] = not self._complete[rank]
        return state


class LiveCheck:
    """Confirms a settled divergence: the same one (kind, ranks, group, sequence number) on two polls in a row,
    with the ranks in its ``evidence`` in the same state (:func:`~rlsdk.debug.facts.fingerprint`) on both."""

    def __init__(self) -> None:
        self._last: tuple[Any, ...] | None = None

    def reset(self) -> None:
        self._last = None

    def observe(self, report: TraceReport, states: Mapping[int, Mapping[str, Any]]) -> Divergence | None:
        """The divergence once confirmed, else ``None`` (remembered for the next poll)."""
        div = report.divergence
        if div is None or not div.settled:
            self._last = None
            return None
        key = (
            div.kind,
            tuple(div.ranks),
            div.group,
            div.seq,
            tuple((rank, fingerprint(states[rank])) for rank in div.evidence if rank in states),
        )
        if key == self._last:
            return div
        self._last = key
        return None
