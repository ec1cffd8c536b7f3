"""What the analyser reports: a :class:`Divergence`, and the helpers that describe the ranks' records in it.

Shared by :mod:`rlsdk.debug.analyze` (collectives), :mod:`rlsdk.debug.p2p` (point-to-point calls) and
:mod:`rlsdk.debug.rootcause` (which divergence to report). Pure functions over plain data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BASES",
    "FORCED_BASES",
    "KINDS",
    "Divergence",
    "age",
    "describe",
    "first_start",
    "fmt",
    "last",
    "make_side",
    "members",
    "pending",
    "rank_state",
]

KINDS = (
    "missing collective",
    "extra collective",
    "op mismatch",
    "shape mismatch",
    "dtype mismatch",
    "reduce-op mismatch",
    "source mismatch",
    "crashed rank",
    "straggler",
    "p2p unmatched",
)
"""Every divergence kind :func:`rlsdk.debug.analyze.analyze` reports."""

BASES = {
    "majority": "a strict majority of the group's ranks (at least two) agree, and the named ranks differ from it",
    "pair": "the two ranks of a send/recv or all-to-all pair disagree: both are named",
    "dead": "the named ranks' processes are gone",
    "cover": "every unmatched or mismatched pair has the named rank on one end, with at least two different peers",
    "lint": "the named ranks' call sits in a rank-conditional branch and the other side's does not",
    "departure": "the named ranks' own call sequences depart from a strict majority of the ranks exactly there",
    "tie": "no evidence picks a side; the named ranks follow a convention (see the candidates)",
    "slow": "the named ranks are still computing (a straggler)",
}
"""How a divergence's ``ranks`` were picked (``Divergence.basis``), with the reason printed in reports."""

FORCED_BASES = frozenset({"majority", "pair", "dead", "cover", "lint", "departure"})
"""The bases that name the ranks from evidence alone (a divergence may be certain only with one of them)."""


@dataclass
class Divergence:
    """A point where the ranks disagree; :func:`~rlsdk.debug.analyze.analyze` reports the root cause among them.

    Attributes:
        kind: one of :data:`KINDS`.
        ranks: the rank(s) at fault (the minority, the lagging or the dead ones).
        group: process group name (``"0"`` is WORLD).
        seq: per-group sequence number of the diverging call (p2p: the p2p sequence number, on the rank of the
            first side, of the unmatched call or of the send).
        sides: one entry per rank involved: ``rank``, ``record`` (the rank's call at ``seq``, or its last call
            in the group when it has none), ``state`` (``waiting``, ``done``, ``idle``, ``busy``, ``crashed``)
            and, for a rank not waiting in a call when its stacks are known, ``main_stack`` (the innermost
            frames of its main thread: where it computes or blocks outside any collective).
        message: one line for humans.
        certain: the verdict is proven: it is ``settled``, its ``ranks`` were named from evidence (``basis`` in
            :data:`FORCED_BASES`), and no other divergence could be the root cause instead (it is not explained
            by another one's waits, and a wait-for cycle was broken by a rank's departing call sequence, not by
            a convention). Otherwise ``candidates`` ranks the alternatives.
        evidence: ranks whose blocked state ``settled`` rests on (a live check wants them unchanged across two
            polls); empty when it rests on issued calls, finished commands or dead processes only.
        history: ``first_difference`` (the first ``seq`` of the group whose call sites differ, with
            ``command``, ``command_seq`` and ``sites`` by rank; ``None`` when they never differ),
            ``last_agreed`` (the last record before it that every rank issued alike) and ``window_start``.
        settled: no future action of any rank can resolve it (the live checks report settled divergences at
            once); implied by ``certain``.
        basis: how ``ranks`` were picked, a key of :data:`BASES`.
        lacking: ranks whose missing calls make this divergence (they never issued the counterpart others wait
            for); empty for a mismatch, where every rank issued its call.
        candidates: the possible root causes, best first (the first is this divergence), each ``kind``,
            ``ranks``, ``group``, ``seq``, ``site``, ``settled``, ``basis`` and ``why`` (one line).
    """

    kind: str
    ranks: list[int]
    group: str
    seq: int
    sides: list[dict[str, Any]]
    message: str
    certain: bool = False
    evidence: list[int] = field(default_factory=list)
    history: dict[str, Any] | None = None
    settled: bool = False
    basis: str = "tie"
    lacking: list[int] = field(default_factory=list)
    candidates: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.certain:
            self.settled = True

    def headline(self) -> str:
        """``diverged at group G seq S: KIND on rank(s) [...] (op at file:line, command C #N)``."""
        rec = next((side["record"] for side in self.sides if side.get("record")), None) or {}
        where = f"{rec.get('op')} at {rec.get('site')}" if rec else "no call"
        command = f", command {rec.get('command')} #{rec.get('command_seq')}" if rec.get("command") else ""
        return f"diverged at group {self.group} seq {self.seq}: {self.kind} on rank(s) {self.ranks} ({where}{command})"

    def site(self) -> str | None:
        """The call site of the first side's record (the call the divergence is about)."""
        rec = next((side["record"] for side in self.sides if side.get("record")), None)
        return None if rec is None else rec.get("site")


def describe(rec: Mapping[str, Any] | None) -> str:
    """One record in one line: op, seq, shapes, dtypes, reduce op, root/peer, splits, call site, thread, command."""
    if not rec:
        return "no call"
    shapes = ", ".join(str(tuple(shape)) for shape in rec["shapes"]) or "-"
    dtypes = ", ".join(rec["dtypes"]) or "-"
    extra = ""
    if rec.get("reduce_op"):
        extra += f" reduce={rec['reduce_op']}"
    if rec.get("root") is not None:
        extra += f" {'peer' if rec.get('p2p') else 'src'}={rec['root']}"
    if rec.get("splits"):
        extra += f" splits in={list(rec['splits'][0])} out={list(rec['splits'][1])}"
    command = f" (command {rec.get('command')} #{rec.get('command_seq')})" if rec.get("command") else ""
    thread = f" [thread {rec['thread_name']}]" if rec.get("thread_name") else ""
    return (
        f"{rec['op']} seq {rec['seq']} shapes=[{shapes}] dtypes=[{dtypes}]{extra} at {rec.get('site')}{thread}{command}"
    )


def pending(rec: Mapping[str, Any]) -> bool:
    """Issued and not seen completed (a crashed rank's tail records are neither)."""
    return rec.get("t_end") is None and not rec.get("from_tail")


def rank_state(state: Mapping[str, Any]) -> str:
    """``crashed``, ``waiting`` (a call is pending), ``idle`` (no command) or ``busy``."""
    if state.get("crashed"):
        return "crashed"
    if any(rec.get("t_end") is None for rec in state.get("records", ())):
        return "waiting"
    return "idle" if state.get("command") is None else "busy"


def age(state: Mapping[str, Any], rec: Mapping[str, Any] | None) -> float | None:
    """Seconds from the record's issue to the state's clock."""
    if rec is None or state.get("now") is None:
        return None
    return float(state["now"]) - float(rec["t_start"])


def last(records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    return dict(records[-1]) if records else None


def fmt(value: Any) -> str:
    """Shapes or a plain value as text: ``[(4,), (2, 3)]``."""
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
        return "[" + ", ".join(str(tuple(v)) for v in value) + "]"
    return str(list(value) if isinstance(value, tuple) else value)


def members(states: Mapping[int, Mapping[str, Any]], group: str) -> list[int]:
    """The ranks of ``group`` present in ``states`` (from the groups a rank reports, else from the records)."""
    for state in states.values():
        info = (state.get("groups") or {}).get(group)
        if info and info.get("ranks"):
            return [rank for rank in info["ranks"] if rank in states]
    return [r for r, st in states.items() if any(rec["group"] == group for rec in st.get("records", ()))]


def make_side(states: Mapping[int, Mapping[str, Any]], rank: int, rec: Mapping[str, Any] | None) -> dict[str, Any]:
    """A divergence's side: the rank, its call (a copy, with the thread's name when not the main thread) and its
    state label (``waiting N s``, ``crashed``, ``idle``, ``busy``)."""
    state = states[rank]
    if state.get("crashed"):
        label = "crashed"
    elif rec is not None and pending(rec):
        label = f"waiting {(age(state, rec) or 0.0):.1f} s"
    else:
        label = rank_state(state)
    record = None if rec is None else dict(rec)
    thread = None if rec is None else rec.get("thread")
    main = state.get("main_thread")
    if record is not None and thread is not None and main is not None and thread != main:
        record["thread_name"] = (state.get("threads") or {}).get(str(thread), str(thread))
    return {"rank": rank, "record": record, "state": label}


def first_start(div: Divergence) -> float:
    """The earliest issue time among the divergence's sides (the machine's monotonic clock)."""
    return min(
        (float(side["record"]["t_start"]) for side in div.sides if side.get("record")),
        default=float("inf"),
    )
