"""Compare the ranks' collective records and name the root cause of their divergence. Pure functions over
plain data.

Input: one *state* per rank, as :func:`rlsdk.debug.tracer.snapshot` returns it (``records``, ``command``,
``now``, ``groups``; optionally ``stacks``), or for a rank that did not answer ``{"rank": r, "crashed": True,
"records": [...from its crash-safe tail...], "detail": "..."}``.

Each process group's collectives are compared by :mod:`rlsdk.debug.collectives` (the first sequence number
where the ranks disagree: a mismatch, a missing, extra or skipped call, a crashed rank or a straggler) and its
point-to-point calls by :mod:`rlsdk.debug.p2p` (posted sends and receives paired by peer and count). One hang
usually shows in several groups; :mod:`rlsdk.debug.rootcause` picks the one that explains the others: it
follows who waits on whom across groups, breaks wait-for cycles at the rank whose own call sequence departs
from the other ranks', and ranks the alternatives (``Divergence.candidates``).

**Settled and certain** (the rules of blocked ranks in :mod:`rlsdk.debug.facts`): a divergence is *settled*
when no future action of any rank can resolve it: every mismatch at one sequence number (op, shape, dtype,
reduce op, source, split sizes; a send/recv pair whose tensors differ; a skipped call whose sequence number
another call took); a missing/extra collective or an unmatched p2p call whose counterpart ranks are dead, have
finished the command (or moved past it to a later one), or are blocked for good; a crashed rank whose process
is known to be gone. A straggler never is. The live check reports settled divergences at once and leaves the
rest to ``launch.hang_timeout_s``; ``evidence`` names the blocked ranks it rests on. A settled divergence is
*certain* when its ranks were named from evidence alone (a strict majority, a dead process, a pair, the rank on
every unmatched pair, a rank-conditional call site, a departing call sequence: ``Divergence.basis``) and no
other divergence could be its cause instead. Two ranks that disagree with no third to side with either are a
tie: the verdict names one by convention, is not certain, and lists both as candidates.

**History** (``Divergence.history``): the first sequence number of the divergence's group, within what every
ring buffer still holds, whose call sites differ across ranks (the ranks took different code paths there,
possibly many clean steps before the divergence, with matching tensors), and the last collective before it that
every rank issued from the same call site with the same tensors.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlsdk.debug.collectives import compare_group
from rlsdk.debug.divergence import BASES, FORCED_BASES, KINDS, Divergence, age, describe, last, members, pending
from rlsdk.debug.divergence import rank_state as _rank_state
from rlsdk.debug.facts import RankFacts
from rlsdk.debug.facts import signature as _signature
from rlsdk.debug.p2p import match_p2p
from rlsdk.debug.rootcause import Departure, departures, root_cause

__all__ = [
    "KINDS",
    "Divergence",
    "TraceReport",
    "analyze",
    "load_report",
    "to_flight_recorder",
]

SiteCheck = Callable[[str], bool]


@dataclass
class TraceReport:
    """What :func:`analyze` found: the first divergence (``None`` when the ranks agree) and each rank's state."""

    divergence: Divergence | None
    states: dict[int, dict[str, Any]]
    summary: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable) for saving; :func:`load_report` reads it back."""
        div = self.divergence
        return {
            "divergence": None if div is None else div.__dict__,
            "summary": self.summary,
            "states": {str(rank): state for rank, state in self.states.items()},
        }

    def __str__(self) -> str:
        lines = []
        div = self.divergence
        if div is None:
            lines.append("collective trace: the ranks agree (no divergence found)")
        else:
            lines.append(f"COLLECTIVE DIVERGENCE: {div.kind} -- {div.message}")
            for side in div.sides:
                lines.append(f"  rank {side['rank']} [{side['state']}]: {describe(side.get('record'))}")
                stack = (side.get("record") or {}).get("stack") or []
                lines.extend(f"      {frame}" for frame in stack[1:3])
                if side.get("main_stack"):
                    lines.append("      main thread now:")
                    lines.extend(f"        {line}" for frame in side["main_stack"] for line in frame.splitlines())
            lines.extend(_verdict_lines(div))
            lines.extend(_history_lines(div.history))
        lines.append("per rank: rank | state | last group:seq op | call site | age (s) | command")
        for row in self.summary:
            age = "-" if row["age_s"] is None else f"{row['age_s']:.1f}"
            lines.append(
                f"  {row['rank']} | {row['state']} | {row['group']}:{row['seq']} {row['op']} | {row['site']} | "
                f"{age} | {row['command']}"
            )
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        faulty = set(self.divergence.ranks) if self.divergence else set()
        head = html.escape(str(self).splitlines()[0])
        cells = "".join(
            "<tr{}><td>{}</td><td>{}</td><td>{}:{}</td><td>{}</td><td>{}</td><td>{}</td></tr>".format(
                ' style="background:#fdd"' if row["rank"] in faulty else "",
                row["rank"],
                html.escape(str(row["state"])),
                html.escape(str(row["group"])),
                row["seq"],
                html.escape(str(row["op"])),
                html.escape(str(row["site"])),
                "-" if row["age_s"] is None else f"{row['age_s']:.1f}",
            )
            for row in self.summary
        )
        return (
            f"<div><b>{head}</b><table><tr><th>rank</th><th>state</th><th>group:seq</th><th>op</th>"
            f"<th>call site</th><th>age (s)</th></tr>{cells}</table></div>"
        )


def _verdict_lines(div: Divergence, shown: int = 5) -> list[str]:
    """Whether it is settled and certain, and otherwise the candidates, best first, with why."""
    lines = []
    if div.settled:
        blocked = f" (ranks {div.evidence} are blocked for good)" if div.evidence else ""
        lines.append(f"  settled: no rank can resolve it{blocked}")
    if div.certain:
        lines.append(f"  certain: {BASES.get(div.basis, div.basis)}")
        return lines
    if not div.settled:
        reason = "it may still resolve"
    elif div.basis not in FORCED_BASES:
        reason = BASES.get(div.basis, div.basis)
    else:
        reason = div.candidates[0]["why"] if div.candidates else "another divergence may be the cause"
    lines.append(f"  not certain ({reason}); candidates, best first:")
    for number, item in enumerate(div.candidates[:shown], start=1):
        lines.append(
            f"    {number}. {item['kind']} on rank(s) {item['ranks']} at group {item['group']} seq {item['seq']} "
            f"({item['site']}; named by {item['basis']}{', settled' if item['settled'] else ''}): {item['why']}"
        )
    if len(div.candidates) > shown:
        lines.append(f"    ... and {len(div.candidates) - shown} more")
    return lines


def _history_lines(history: Mapping[str, Any] | None) -> list[str]:
    if not history:
        return []
    lines = []
    first = history.get("first_difference")
    if first is not None:
        sites = "; ".join(f"rank {rank} at {site}" for rank, site in sorted(first["sites"].items()))
        lines.append(
            f"  history: the ranks' call sites first differ at group {first['group']} seq {first['seq']} "
            f"(command {first['command']} #{first['command_seq']}): {sites}"
        )
    last = history.get("last_agreed")
    if last is not None:
        lines.append(f"  last collective every rank agrees on: {describe(last)}")
    elif first is not None:
        lines.append(f"  (they differ from the oldest record every ring buffer holds, seq {history['window_start']})")
    return lines


def _default_site_check(site: str) -> bool:
    from rlsdk.debug.lint import site_is_rank_conditional

    return site_is_rank_conditional(site)


class _Departures(Mapping[int, Departure]):
    """:func:`~rlsdk.debug.rootcause.departures`, computed on first use (most analyses never need them)."""

    def __init__(self, states: Mapping[int, Mapping[str, Any]]) -> None:
        self._states = states
        self._found: dict[int, Departure] | None = None

    def _get(self) -> dict[int, Departure]:
        if self._found is None:
            self._found = departures(self._states)
        return self._found

    def __getitem__(self, rank: int) -> Departure:
        return self._get()[rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def analyze(
    states: Mapping[int, Mapping[str, Any]],
    *,
    site_check: SiteCheck | None = None,
    acknowledged: Mapping[str, int] | None = None,
) -> TraceReport:
    """Find the root cause of the ranks' divergence (see the module docstring).

    Args:
        states: rank -> state (a tracer snapshot, a live poll's view, or a crashed-rank entry; ``dead: True`` in a
            crashed entry says the process is known to be gone).
        site_check: ``"file:line" -> bool``: is that call inside a rank-conditional branch? Used to tell which
            side of a tie issued the odd call. Default: parse the file with :mod:`rlsdk.debug.lint` (``False``
            when it cannot be read).
        acknowledged: group -> sequence number up to which its collectives are not compared: a divergence there
            was reported and the ranks got past it (a silently wrong result), so the next one can be found.
    """
    check = site_check or _default_site_check
    floors = acknowledged or {}
    ranks = sorted(states)
    facts = RankFacts(states, lambda group: members(states, group))
    deps = _Departures(states)
    found: list[Divergence] = []
    for group in sorted({rec["group"] for st in states.values() for rec in st.get("records", ())}):
        compared = compare_group(states, group, members(states, group), check, facts, deps, floors.get(group, 0))
        if compared is not None:
            found.append(compared)
        found += match_p2p(states, group, facts, deps)
    divergence = root_cause(states, found, deps)
    if divergence is None:
        divergence = _dead_ranks(states, facts)
    if divergence is not None:
        divergence.history = _history(states, divergence, facts)
        for side in divergence.sides:
            if side["state"] == "busy":  # computing or blocked outside any collective: where?
                stack = _main_stack(states[side["rank"]])
                if stack:
                    side["main_stack"] = stack
    return TraceReport(divergence, {r: dict(states[r]) for r in ranks}, _summary(states))


def _dead_ranks(states: Mapping[int, Mapping[str, Any]], facts: RankFacts) -> Divergence | None:
    """Ranks that died or stopped answering with no divergence in their records."""
    dead = [rank for rank in sorted(states) if states[rank].get("crashed")]
    if not dead:
        return None
    gone = all(facts.dead(rank) for rank in dead)
    div = Divergence(
        "crashed rank",
        dead,
        "0",
        0,
        [{"rank": r, "record": last(states[r].get("records", [])), "state": "crashed"} for r in dead],
        f"rank(s) {dead} died or stopped answering ({states[dead[0]].get('detail', 'no detail')})",
        certain=gone,
        basis="dead" if gone else "tie",
    )
    div.candidates = [
        {"kind": div.kind, "ranks": dead, "group": "0", "seq": 0, "site": div.site(), "settled": gone,
         "basis": div.basis, "why": "no divergence in the records"}
    ]  # fmt: skip
    return div


def _main_stack(state: Mapping[str, Any], depth: int = 3) -> list[str]:
    stacks = state.get("stacks") or {}
    for name, frames in stacks.items():
        if str(name).startswith("MainThread"):
            return [str(frame).strip() for frame in list(frames)[-depth:]]
    return []


def _history(states: Mapping[int, Mapping[str, Any]], div: Divergence, facts: RankFacts) -> dict[str, Any] | None:
    """See ``Divergence.history``: the group's first sequence number whose call sites differ across ranks, and
    the last collective before it every rank issued alike, within what every ring buffer holds."""
    ranks = [rank for rank in members(states, div.group) if not states[rank].get("crashed")]
    if len(ranks) < 2:
        ranks = members(states, div.group)
    tables = {
        rank: {
            rec["seq"]: rec
            for rec in states[rank].get("records", ())
            if rec["group"] == div.group and not rec.get("p2p")
        }
        for rank in ranks
    }
    if not tables or not all(tables.values()):
        return None
    lo = max(min(table) for table in tables.values())
    p2p = bool(div.sides and div.sides[0].get("record") and div.sides[0]["record"].get("p2p"))
    upto = min(max(table) for table in tables.values()) + 1 if p2p or div.kind == "crashed rank" else div.seq
    first: dict[str, Any] | None = None
    agreed: dict[str, Any] | None = None
    for seq in range(lo, upto):
        recs = {rank: table.get(seq) for rank, table in tables.items()}
        if any(rec is None for rec in recs.values()):
            continue
        if len({_signature(rec) for rec in recs.values()}) > 1:
            break
        sites = {rank: rec.get("site") for rank, rec in recs.items()}
        if len(set(sites.values())) > 1:
            ref = recs[min(recs)]
            first = {
                "group": div.group,
                "seq": seq,
                "command": ref.get("command"),
                "command_seq": ref.get("command_seq"),
                "sites": sites,
            }
            break
        agreed = {key: value for key, value in recs[min(recs)].items() if key != "stack"}
    return {"window_start": lo, "first_difference": first, "last_agreed": agreed}


def _summary(states: Mapping[int, Mapping[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for rank in sorted(states):
        state = states[rank]
        waiting = [rec for rec in state.get("records", ()) if pending(rec)]
        records = [rec for rec in state.get("records", ()) if not rec.get("p2p")] or list(state.get("records", ()))
        latest = waiting[-1] if waiting else records[-1] if records else None
        rows.append(
            {
                "rank": rank,
                "state": _rank_state(state),
                "group": None if latest is None else latest["group"],
                "seq": None if latest is None else latest["seq"],
                "op": None if latest is None else latest["op"],
                "site": None if latest is None else latest.get("site"),
                "age_s": age(state, latest),
                "command": state.get("command"),
            }
        )
    return rows


def load_report(directory: str | os.PathLike[str]) -> TraceReport:
    """Re-analyse the rank states saved under ``directory`` (an ``OUTPUT/traces/<name>`` folder holding
    ``rank_N.json`` files, or an output root whose ``traces/`` holds such folders: the newest one is used).

    Raises:
        FileNotFoundError: no saved rank states there.
    """
    from pathlib import Path

    root = Path(directory)
    candidates = [root] if list(root.glob("rank_*.json")) else []
    if not candidates:
        folders = sorted((p for p in (root / "traces").glob("*") if list(p.glob("rank_*.json"))), key=os.path.getmtime)
        candidates = folders[-1:]
    if not candidates:
        raise FileNotFoundError(f"no saved rank traces (rank_N.json) under {root} or {root / 'traces'}")
    states = {}
    for path in candidates[0].glob("rank_*.json"):
        state = json.loads(path.read_text())
        states[int(state["rank"])] = state
    return analyze(states)


_FR_NAMES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "_allgather_base": "_all_gather_base",
    "allgather_coalesced": "ALLGATHER_coalesced",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "monitored_barrier": "barrier",
    "recv_anysource": "recv",
}


def _profiling_name(rec: Mapping[str, Any], rank: Any) -> str:
    op = _FR_NAMES.get(rec["op"], rec["op"])
    if op == "send":
        return f"gloo:send {rank}->{rec.get('root')}"
    if op == "recv":
        return f"gloo:recv {rank}<-{rec.get('root')}"
    return f"gloo:{op}"


def to_flight_recorder(state: Mapping[str, Any], *, pg_timeout_ms: int = 0) -> dict[str, Any]:
    """One rank's state in the PyTorch Flight Recorder dump shape (``version``, ``pg_config``, ``entries``).

    Each entry fills ``record_id``, ``pg_id``, ``process_group`` (name, description), ``collective_seq_id``,
    ``p2p_seq_id``, ``op_id``, ``profiling_name`` (``"gloo:all_reduce"``, ``"gloo:send 0->1"``: the Flight
    Recorder's op names), ``time_created_ns``, ``input_sizes``,
    ``input_dtypes``, ``output_sizes``/``output_dtypes`` (copied from the inputs: the tracer does not record
    outputs), ``state`` (``completed`` or ``scheduled``), ``time_discovered_completed_ns``, ``timeout_ms``,
    ``is_p2p``, ``retired`` and ``frames`` (``name``, ``filename``, ``line``). Times are the rank's monotonic
    clock in ns. The process group is named (never ``''``), which the bundled analyser needs.
    """
    entries = []
    for index, rec in enumerate(state.get("records", ())):
        frames = []
        for text in rec.get("stack") or [f"{rec.get('site')} in ?"]:
            location, _, name = text.partition(" in ")
            filename, _, line = location.rpartition(":")
            frames.append({"name": name, "filename": filename, "line": int(line) if line.isdigit() else 0})
        p2p = bool(rec.get("p2p"))
        entries.append(
            {
                "record_id": index,
                "pg_id": int(rec["group"]) if str(rec["group"]).isdigit() else 0,
                "process_group": [str(rec["group"]), "default_pg" if rec["group"] == "0" else "traced"],
                "collective_seq_id": 0 if p2p else rec["seq"],
                "p2p_seq_id": rec["seq"] if p2p else 0,
                "op_id": rec["seq"],
                "profiling_name": _profiling_name(rec, state.get("rank")),
                "time_created_ns": int(float(rec["t_start"]) * 1e9),
                "input_sizes": [list(shape) for shape in rec["shapes"]],
                "input_dtypes": list(rec["dtypes"]),
                "output_sizes": [list(shape) for shape in rec["shapes"]],
                "output_dtypes": list(rec["dtypes"]),
                "state": "scheduled" if rec.get("t_end") is None else "completed",
                "time_discovered_started_ns": int(float(rec["t_start"]) * 1e9),
                "time_discovered_completed_ns": None if rec.get("t_end") is None else int(float(rec["t_end"]) * 1e9),
                "timeout_ms": pg_timeout_ms,
                "is_p2p": p2p,
                "retired": rec.get("t_end") is not None,
                "frames": frames,
            }
        )
    groups = state.get("groups") or {"0": {"ranks": []}}
    return {
        "version": "2.10",
        "rank": state.get("rank"),
        "pg_config": {
            name: {"name": name, "desc": "default_pg" if name == "0" else "traced", "ranks": str(info.get("ranks"))}
            for name, info in groups.items()
        },
        "pg_status": {},
        "entries": entries,
    }
