"""Compare the ranks' collective records and name the first divergence. Pure functions over plain data.

Input: one *state* per rank, as :func:`rlsdk.debug.tracer.snapshot` returns it (``records``, ``command``,
``now``, ``groups``; optionally ``stacks``), or for a rank that did not answer ``{"rank": r, "crashed": True,
"records": [...from its crash-safe tail...], "detail": "..."}``.

Per process group, collective records are aligned by their per-group sequence number. The first sequence number
where the ranks disagree is the divergence:

- every rank has the call, but they differ: ``op mismatch`` (or ``extra collective`` when one side's next call
  matches, or when only one side's call site sits in a rank-conditional branch), ``shape mismatch``, ``dtype
  mismatch``, ``reduce-op mismatch``, ``source mismatch`` (broadcast/reduce/gather/scatter root);
- some ranks lack it: ``crashed rank`` (the rank is dead), ``straggler`` (the rank still runs the same command
  and is not inside a collective: slow, not a desync), ``missing collective`` (the rank finished or moved on),
  ``extra collective`` (a minority of ranks issued it; with two ranks, when its call site is rank-conditional).

Point-to-point calls are paired per (sender, receiver) and group, in order: the k-th ``send`` from a to b pairs
with b's k-th ``recv`` from a (the tracer's ``peer_seq``). Any-source receives (``recv_anysource``) are paired
afterwards, by order, with the sends to that rank no explicit receive took (a completed one with the sender the
tracer learned takes that sender's oldest such send first); mixing explicit and any-source receives from one
peer can pair the wrong messages, though the counts stay right. A pair whose shapes or dtypes differ is a
``shape mismatch`` / ``dtype mismatch`` (both ranks named). A call without a counterpart is ``p2p unmatched``
(the peer lacking it is named) when the peer finished, moved to another command, or is stuck elsewhere while the
caller waits; ``straggler`` when the peer still computes; ``crashed rank`` when it died. A missing/extra
collective whose lagging rank is stuck in an unmatched p2p call is reported as that p2p divergence, which
explains it (e.g. rank 0 waits in ``recv`` from 1 while rank 1 waits in an ``allreduce`` rank 0 never reaches).
More generally, a missing/extra collective whose lagging ranks are all blocked in the calls of another
divergence is explained by that one, which is reported instead (a rank stuck in its tensor-parallel group is
absent from its data-parallel group's next collective).

``all_to_all_single`` inputs may differ in length across ranks: their first dimension is left out of the
signature, and the split sizes are checked instead (rank i's input split for j must equal rank j's output split
for i): a mismatch is a ``shape mismatch`` naming both ranks.

**Certainty** (``Divergence.certain``; the rules in :mod:`rlsdk.debug.facts`): every mismatch at one sequence
number (op, shape, dtype, reduce op, source, split sizes; a send/recv pair whose tensors differ) is certain; a
missing/extra collective or an unmatched p2p call is certain when every rank that would have to issue the
counterpart is dead, has finished the command (or moved past it to a later one), or is blocked for good; a
crashed rank is certain when its process is known to be gone. A straggler never is. The live check reports
certain divergences at once and leaves the rest to ``launch.hang_timeout_s``; ``evidence`` names the blocked
ranks whose unchanged state the certainty rests on.

**History** (``Divergence.history``): the first sequence number of the divergence's group, within what every
ring buffer still holds, whose call sites differ across ranks (the ranks took different code paths there,
possibly many clean steps before the divergence, with matching tensors), and the last collective before it that
every rank issued from the same call site with the same tensors.
"""

from __future__ import annotations

import html
import json
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlsdk.debug.facts import ALL_TO_ALL, RankFacts
from rlsdk.debug.facts import signature as _signature

__all__ = [
    "KINDS",
    "Divergence",
    "TraceReport",
    "analyze",
    "load_report",
    "to_flight_recorder",
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
"""Every divergence kind :func:`analyze` reports."""

SiteCheck = Callable[[str], bool]


@dataclass
class Divergence:
    """The first point where the ranks disagree.

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
        certain: no future action of any rank can resolve it (see the module docstring).
        evidence: ranks whose blocked state the certainty rests on (a live check wants them unchanged across two
            polls); empty when it rests on issued calls, finished commands or dead processes only.
        history: ``first_difference`` (the first ``seq`` of the group whose call sites differ, with
            ``command``, ``command_seq`` and ``sites`` by rank; ``None`` when they never differ),
            ``last_agreed`` (the last record before it that every rank issued alike) and ``window_start``.
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

    def headline(self) -> str:
        """``diverged at group G seq S: KIND on rank(s) [...] (op at file:line, command C #N)``."""
        rec = next((side["record"] for side in self.sides if side.get("record")), None) or {}
        where = f"{rec.get('op')} at {rec.get('site')}" if rec else "no call"
        command = f", command {rec.get('command')} #{rec.get('command_seq')}" if rec.get("command") else ""
        return f"diverged at group {self.group} seq {self.seq}: {self.kind} on rank(s) {self.ranks} ({where}{command})"


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
                lines.append(f"  rank {side['rank']} [{side['state']}]: {_describe(side.get('record'))}")
                stack = (side.get("record") or {}).get("stack") or []
                lines.extend(f"      {frame}" for frame in stack[1:3])
                if side.get("main_stack"):
                    lines.append("      main thread now:")
                    lines.extend(f"        {line}" for frame in side["main_stack"] for line in frame.splitlines())
            if div.certain:
                lines.append(
                    "  certain: no rank can resolve it"
                    + (f" (ranks {div.evidence} are blocked for good)" if div.evidence else "")
                )
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
        lines.append(f"  last collective every rank agrees on: {_describe(last)}")
    elif first is not None:
        lines.append(f"  (they differ from the oldest record every ring buffer holds, seq {history['window_start']})")
    return lines


def _describe(rec: Mapping[str, Any] | None) -> str:
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


def _rank_state(state: Mapping[str, Any]) -> str:
    if state.get("crashed"):
        return "crashed"
    if any(rec.get("t_end") is None for rec in state.get("records", ())):
        return "waiting"
    return "idle" if state.get("command") is None else "busy"


def _age(state: Mapping[str, Any], rec: Mapping[str, Any] | None) -> float | None:
    if rec is None or state.get("now") is None:
        return None
    return float(state["now"]) - float(rec["t_start"])


def _default_site_check(site: str) -> bool:
    from rlsdk.debug.lint import site_is_rank_conditional

    return site_is_rank_conditional(site)


def analyze(
    states: Mapping[int, Mapping[str, Any]],
    *,
    site_check: SiteCheck | None = None,
    acknowledged: Mapping[str, int] | None = None,
) -> TraceReport:
    """Find the first divergence between the ranks' records (see the module docstring).

    Args:
        states: rank -> state (a tracer snapshot, a live poll's view, or a crashed-rank entry; ``dead: True`` in a
            crashed entry says the process is known to be gone).
        site_check: ``"file:line" -> bool``: is that call inside a rank-conditional branch? Used to tell an
            extra collective from an op mismatch with two ranks. Default: parse the file with
            :mod:`rlsdk.debug.lint` (``False`` when it cannot be read).
        acknowledged: group -> sequence number up to which its collectives are not compared: a divergence there
            was reported and the ranks got past it (a silently wrong result), so the next one can be found.
    """
    check = site_check or _default_site_check
    floors = acknowledged or {}
    ranks = sorted(states)
    facts = RankFacts(states, lambda group: _members(states, group))
    found: list[Divergence] = []
    for group in sorted({rec["group"] for st in states.values() for rec in st.get("records", ())}):
        members = _members(states, group)
        compared = _compare_group(states, group, members, check, facts, floors.get(group, 0))
        for div in (compared, _match_p2p(states, group, facts)):
            if div is not None:
                found.append(div)
    divergence = _root_cause(states, found)
    if divergence is None:
        dead = [rank for rank in ranks if states[rank].get("crashed")]
        if dead:
            divergence = Divergence(
                "crashed rank",
                dead,
                "0",
                0,
                [{"rank": r, "record": _last(states[r].get("records", [])), "state": "crashed"} for r in dead],
                f"rank(s) {dead} died or stopped answering ({states[dead[0]].get('detail', 'no detail')})",
                certain=all(facts.dead(rank) for rank in dead),
            )
    if divergence is not None:
        divergence.history = _history(states, divergence, facts)
        for side in divergence.sides:
            if side["state"] == "busy":  # computing or blocked outside any collective: where?
                stack = _main_stack(states[side["rank"]])
                if stack:
                    side["main_stack"] = stack
    return TraceReport(divergence, {r: dict(states[r]) for r in ranks}, _summary(states))


_ABSENCE_KINDS = ("missing collective", "extra collective", "straggler")


def _waiting_calls(states: Mapping[int, Mapping[str, Any]], div: Divergence) -> set[tuple[int, str, bool, int]]:
    """The pending calls a divergence is about: (rank, group, p2p, seq)."""
    if any(side.get("record") and side["record"].get("p2p") for side in div.sides[:1]):
        rec = div.sides[0]["record"]
        return {(div.sides[0]["rank"], rec["group"], True, rec["seq"])}
    return {
        (rank, div.group, False, div.seq)
        for rank, state in states.items()
        for rec in state.get("records", ())
        if rec["group"] == div.group and not rec.get("p2p") and rec["seq"] == div.seq and _pending(rec)
    }


def _root_cause(states: Mapping[int, Mapping[str, Any]], found: list[Divergence]) -> Divergence | None:
    """The divergence to report among one per group (collectives) and one per group (p2p): drop a missing/extra
    collective whose lagging ranks all wait in another divergence's calls (that one explains it); then prefer a
    certain divergence; then the earliest."""
    if not found:
        return None
    waiting = [_waiting_calls(states, div) for div in found]
    kept = []
    for index, div in enumerate(found):
        if div.kind in _ABSENCE_KINDS:
            others = set().union(*(calls for i, calls in enumerate(waiting) if i != index))
            lagging = [side["rank"] for side in div.sides[1:]] if not div.sides[0]["record"].get("p2p") else []
            pending = {
                rank: {
                    (rank, rec["group"], bool(rec.get("p2p")), rec["seq"])
                    for rec in states[rank].get("records", ())
                    if _pending(rec)
                }
                for rank in lagging
            }
            if lagging and all(pending[rank] & others for rank in lagging):
                continue
        kept.append(div)
    kept = kept or found
    return min(kept, key=lambda div: (not div.certain, _first_start(div)))


def _main_stack(state: Mapping[str, Any], depth: int = 3) -> list[str]:
    stacks = state.get("stacks") or {}
    for name, frames in stacks.items():
        if str(name).startswith("MainThread"):
            return [str(frame).strip() for frame in list(frames)[-depth:]]
    return []


def _history(states: Mapping[int, Mapping[str, Any]], div: Divergence, facts: RankFacts) -> dict[str, Any] | None:
    """See ``Divergence.history``: the group's first sequence number whose call sites differ across ranks, and
    the last collective before it every rank issued alike, within what every ring buffer holds."""
    members = [rank for rank in _members(states, div.group) if not states[rank].get("crashed")]
    if len(members) < 2:
        members = _members(states, div.group)
    tables = {
        rank: {
            rec["seq"]: rec
            for rec in states[rank].get("records", ())
            if rec["group"] == div.group and not rec.get("p2p")
        }
        for rank in members
    }
    if not tables or not all(tables.values()):
        return None
    lo = max(min(table) for table in tables.values())
    p2p = bool(div.sides and div.sides[0].get("record") and div.sides[0]["record"].get("p2p"))
    upto = min(max(table) for table in tables.values()) + 1 if p2p or div.kind == "crashed rank" else div.seq
    first: dict[str, Any] | None = None
    last: dict[str, Any] | None = None
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
        last = {key: value for key, value in recs[min(recs)].items() if key != "stack"}
    return {"window_start": lo, "first_difference": first, "last_agreed": last}


def _first_start(div: Divergence) -> float:
    return min(
        (float(side["record"]["t_start"]) for side in div.sides if side.get("record")),
        default=float("inf"),
    )


def _pending(rec: Mapping[str, Any]) -> bool:
    return rec.get("t_end") is None and not rec.get("from_tail")


def _truncated(state: Mapping[str, Any]) -> bool:
    """Older records may be gone: a full ring buffer, or a crashed rank's short tail."""
    capacity = state.get("capacity")
    return (
        bool(state.get("crashed"))
        or bool(state.get("truncated"))
        or (capacity is not None and len(state.get("records", ())) >= capacity)
    )


def _match_p2p(states: Mapping[int, Mapping[str, Any]], group: str, facts: RankFacts) -> Divergence | None:
    """Pair sends with receives in ``group`` (see the module docstring); the earliest divergence, or ``None``."""
    sends: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    recvs: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    anysource: dict[int, list[dict[str, Any]]] = {}
    for rank, state in states.items():
        for rec in state.get("records", ()):
            if rec["group"] != group or not rec.get("p2p"):
                continue
            if rec["op"] == "send" and rec.get("peer_seq") is not None:
                sends.setdefault((rank, rec["root"]), {})[rec["peer_seq"]] = rec
            elif rec["op"] == "recv" and rec.get("peer_seq") is not None:
                recvs.setdefault((rec["root"], rank), {})[rec["peer_seq"]] = rec
            elif rec["op"] in ("recv", "recv_anysource"):
                anysource.setdefault(rank, []).append(rec)
    found: list[tuple[float, Divergence]] = []
    unmatched: list[tuple[int, int, dict[str, Any]]] = []  # (holder, peer or -1 for any source, record)
    for src, dst in sorted(set(sends) | set(recvs)):
        if src not in states or dst not in states:
            continue
        sent, got = sends.get((src, dst), {}), recvs.get((src, dst), {})
        sides = ((src, sent), (dst, got))
        if any(_truncated(states[rank]) and not keys for rank, keys in sides):
            # nothing left to compare against; a waiting call on a dead peer is still a crashed rank
            for rank, keys in sides:
                peer = dst if rank == src else src
                unmatched += [(rank, peer, rec) for rec in keys.values() if _pending(rec)]
            continue
        lo = max([min(keys) for rank, keys in sides if _truncated(states[rank]) and keys] + [1])
        for k in range(lo, max([*sent, *got]) + 1):
            send, recv = sent.get(k), got.get(k)
            if send is not None and recv is not None:
                div = _p2p_mismatch(states, group, src, dst, k, send, recv)
                if div is not None:
                    found.append((_first_start(div), div))
            elif send is not None:
                unmatched.append((src, dst, send))
            elif recv is not None:
                unmatched.append((dst, src, recv))
    # any-source receives take the sends no explicit receive took, oldest first
    for dst, pool in anysource.items():
        spare = sorted(
            (item for item in unmatched if item[2]["op"] == "send" and item[1] == dst), key=lambda i: i[2]["t_start"]
        )
        for recv in sorted(pool, key=lambda rec: rec["t_start"]):
            pick = next((item for item in spare if recv.get("root") in (None, item[0])), None)
            if pick is None:
                unmatched.append((dst, -1 if recv.get("root") is None else recv["root"], recv))
                continue
            spare.remove(pick)
            unmatched.remove(pick)
            div = _p2p_mismatch(states, group, pick[0], dst, pick[2].get("peer_seq"), pick[2], recv)
            if div is not None:
                found.append((_first_start(div), div))
    for holder, peer, rec in unmatched:
        div = _p2p_unmatched(states, group, holder, peer, rec, facts)
        if div is not None:
            found.append((_first_start(div), div))
    return min(found, key=lambda item: item[0])[1] if found else None


def _p2p_mismatch(
    states: Mapping[int, Mapping[str, Any]],
    group: str,
    src: int,
    dst: int,
    k: int | None,
    send: dict[str, Any],
    recv: dict[str, Any],
) -> Divergence | None:
    for key, kind in (("shapes", "shape mismatch"), ("dtypes", "dtype mismatch")):
        a, b = _fmt(send.get(key)), _fmt(recv.get(key))
        if a != b:
            return Divergence(
                kind,
                sorted({src, dst}),
                group,
                send["seq"],
                [_side(states, src, send), _side(states, dst, recv)],
                f"group {group} p2p #{k} from rank {src} to rank {dst}: send at {send.get('site')} {key}={a} "
                f"(rank {src} p2p seq {send['seq']}), recv at {recv.get('site')} {key}={b} "
                f"(rank {dst} p2p seq {recv['seq']})",
                certain=True,
            )
    return None


def _p2p_unmatched(
    states: Mapping[int, Mapping[str, Any]],
    group: str,
    holder: int,
    peer: int,
    rec: dict[str, Any],
    facts: RankFacts,
) -> Divergence | None:
    """A call without a counterpart: a divergence unless it is merely in flight (see the module docstring)."""
    command_seq = rec.get("command_seq")
    never, evidence = facts.never(int(command_seq)) if command_seq is not None else (frozenset(), frozenset())
    sending = rec["op"] == "send"
    what = f"{rec['op']} {'to' if sending else 'from'} rank {peer}" if peer >= 0 else f"{rec['op']} from any rank"
    where = f"group {group}, rank {holder} p2p seq {rec['seq']}" + (
        f", #{rec['peer_seq']} between them" if rec.get("peer_seq") is not None else ""
    )
    if peer < 0:  # an any-source receive no send reaches: every other rank could be the culprit
        others = [rank for rank in sorted(states) if rank != holder]
        if not _pending(rec) or not others:
            return None
        certain = all(rank in never for rank in others)
        return Divergence(
            "p2p unmatched",
            others,
            group,
            rec["seq"],
            [_side(states, holder, rec)] + [_p2p_peer_side(states, rank) for rank in others],
            f"rank {holder} waits in {what} at {rec.get('site')} ({where}); no rank sends to it",
            certain=certain,
            evidence=sorted(evidence) if certain else [],
        )
    peer_state = states[peer]
    sides = [_side(states, holder, rec), _p2p_peer_side(states, peer)]
    counterpart = "recv" if sending else "send"
    if peer_state.get("crashed"):
        return Divergence(
            "crashed rank",
            [peer],
            group,
            rec["seq"],
            sides,
            f"rank {peer} died before the {counterpart} matching rank {holder}'s {what} at {rec.get('site')} "
            f"({where}; {peer_state.get('detail', '')})",
            certain=facts.dead(peer),
        )
    peer_pending = [r for r in peer_state.get("records", ()) if _pending(r)]
    holder_pending = [r for r in states[holder].get("records", ()) if _pending(r)]
    command = (rec.get("command"), rec.get("command_seq"))
    same_command = (peer_state.get("command"), peer_state.get("command_seq")) == command and command[0] is not None
    not_started = command_seq is not None and facts.not_started(peer, int(command_seq))
    if not same_command and not not_started:
        state = "finished it" if peer_state.get("command") is None else f"moved on to {peer_state.get('command')}"
        detail = f"rank {peer} {state}"
    elif peer_pending and holder_pending:
        stuck = peer_pending[-1]
        # both inside the same collective: it completes, and the p2p call after it may still be matched
        if any(
            not r.get("p2p") and not stuck.get("p2p") and (r["group"], r["seq"]) == (stuck["group"], stuck["seq"])
            for r in holder_pending
        ):
            return None
        detail = f"rank {peer} is stuck in {_describe(stuck)}"
    elif (not peer_pending or not_started) and _pending(rec):
        wait = _age(states[holder], rec)
        return Divergence(
            "straggler",
            [peer],
            group,
            rec["seq"],
            sides,
            f"rank {peer} has not reached the {counterpart} matching rank {holder}'s {what} at {rec.get('site')} "
            f"({where}) yet: still running command {command[0]} outside any collective while rank {holder} waits"
            f"{'' if wait is None else f' {wait:.1f} s'} (slow, not a desync)",
        )
    else:
        return None  # in flight: the peer may still post it
    certain = peer in never
    return Divergence(
        "p2p unmatched",
        [peer],
        group,
        rec["seq"],
        sides,
        f"rank {holder}'s {what} at {rec.get('site')} ({where}) has no matching {counterpart} on rank {peer}: {detail}",
        certain=certain,
        evidence=sorted(evidence) if certain else [],
    )


def _p2p_peer_side(states: Mapping[int, Mapping[str, Any]], rank: int) -> dict[str, Any]:
    records = states[rank].get("records", ())
    pending = [rec for rec in records if _pending(rec)]
    return _side(states, rank, pending[-1] if pending else _last(records))


def _members(states: Mapping[int, Mapping[str, Any]], group: str) -> list[int]:
    for state in states.values():
        info = (state.get("groups") or {}).get(group)
        if info and info.get("ranks"):
            return [rank for rank in info["ranks"] if rank in states]
    return [r for r, st in states.items() if any(rec["group"] == group for rec in st.get("records", ()))]


def _last(records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    return dict(records[-1]) if records else None


def _compare_group(
    states: Mapping[int, Mapping[str, Any]],
    group: str,
    members: list[int],
    check: SiteCheck,
    facts: RankFacts,
    floor: int = 0,
) -> Divergence | None:
    by_rank: dict[int, dict[int, dict[str, Any]]] = {
        rank: {
            rec["seq"]: rec for rec in states[rank].get("records", ()) if rec["group"] == group and not rec.get("p2p")
        }
        for rank in members
    }
    nonempty = [seqs for seqs in by_rank.values() if seqs]
    if not nonempty:
        return None
    lo = max(min(seqs) for seqs in nonempty)  # older records may have left a rank's ring buffer
    hi = max(max(seqs) for seqs in nonempty)
    for seq in range(max(lo, floor + 1), hi + 1):
        present = {rank: seqs[seq] for rank, seqs in by_rank.items() if seq in seqs}
        # absent: has not issued it; a rank past it whose record is not in view (a partial view) is neither
        absent = [rank for rank in members if rank not in present and facts.lacks(rank, group, seq)]
        sigs = Counter(_signature(rec) for rec in present.values())
        if len(sigs) > 1:
            div = _mismatch(states, group, seq, present, by_rank, check)
            div.certain = True  # both calls were issued at the same sequence number: nothing can make them match
            return div
        if absent and present:
            return _absence(states, group, seq, present, absent, by_rank, check, facts)
        if len(present) == len(members) and next(iter(present.values()))["op"] in ALL_TO_ALL:
            div = _split_mismatch(states, group, seq, members, present)
            if div is not None:
                return div
    return None


def _split_mismatch(
    states: Mapping[int, Mapping[str, Any]],
    group: str,
    seq: int,
    members: list[int],
    present: dict[int, dict[str, Any]],
) -> Divergence | None:
    """All-to-all: rank i's input split for j must equal rank j's output split for i (members in group order)."""
    size = len(members)
    splits = {}
    for rank, rec in present.items():
        value = rec.get("splits")
        if not value or len(value) != 2:
            return None
        in_split, out_split = (list(part) for part in value)
        if not in_split and rec["shapes"] and rec["shapes"][0]:
            in_split = [rec["shapes"][0][0] // size] * size  # an even split
        splits[rank] = (in_split, out_split)
    for i, src in enumerate(members):
        for j, dst in enumerate(members):
            sent, expected = splits[src][0], splits[dst][1]
            if len(sent) != size or len(expected) != size or sent[j] == expected[i]:
                continue  # an unknown (even) output split is not checked
            return Divergence(
                "shape mismatch",
                sorted({src, dst}),
                group,
                seq,
                [_side(states, src, present[src]), _side(states, dst, present[dst])],
                f"group {group} seq {seq} {present[src]['op']}: rank {src} sends {sent[j]} rows to rank {dst} "
                f"(input_split_sizes {sent}), which expects {expected[i]} from it (output_split_sizes {expected})",
                certain=True,
            )
    return None


def _side(states: Mapping[int, Mapping[str, Any]], rank: int, rec: Mapping[str, Any] | None) -> dict[str, Any]:
    state = states[rank]
    if state.get("crashed"):
        label = "crashed"
    elif rec is not None and rec.get("t_end") is None and not rec.get("from_tail"):
        label = f"waiting {(_age(state, rec) or 0.0):.1f} s"
    else:
        label = _rank_state(state)
    record = None if rec is None else dict(rec)
    thread = None if rec is None else rec.get("thread")
    main = state.get("main_thread")
    if record is not None and thread is not None and main is not None and thread != main:
        record["thread_name"] = (state.get("threads") or {}).get(str(thread), str(thread))
    return {"rank": rank, "record": record, "state": label}


def _mismatch(
    states: Mapping[int, Mapping[str, Any]],
    group: str,
    seq: int,
    present: dict[int, dict[str, Any]],
    by_rank: dict[int, dict[int, dict[str, Any]]],
    check: SiteCheck,
) -> Divergence:
    counts = Counter(_signature(rec) for rec in present.values())
    top = max(counts.values())
    # the majority signature; on a tie, the lowest rank's
    majority = next(_signature(present[r]) for r in sorted(present) if counts[_signature(present[r])] == top)
    good = [r for r in sorted(present) if _signature(present[r]) == majority]
    bad = [r for r in sorted(present) if _signature(present[r]) != majority]
    a, b = present[good[0]], present[bad[0]]
    sides = [_side(states, good[0], a)] + [_side(states, r, present[r]) for r in bad]
    where = f"group {group} seq {seq}"

    def diverge(kind: str, ranks: list[int], message: str) -> Divergence:
        return Divergence(kind, ranks, group, seq, sides, message)

    if a["op"] != b["op"]:
        b_next = by_rank[bad[0]].get(seq + 1)
        a_next = by_rank[good[0]].get(seq + 1)
        if b_next is not None and _signature(b_next) == _signature(a):
            return diverge(
                "extra collective",
                bad,
                f"rank(s) {bad} issued an extra {b['op']} "
                f"at {b['site']} ({where}) before the {a['op']} the others issued",
            )
        if a_next is not None and _signature(a_next) == _signature(b):
            return diverge(
                "extra collective",
                good,
                f"rank(s) {good} issued an extra {a['op']} at {a['site']} ({where}) that rank(s) {bad} did not",
            )
        a_cond, b_cond = check(str(a.get("site"))), check(str(b.get("site")))
        if b_cond and not a_cond:
            return diverge(
                "extra collective",
                bad,
                f"rank(s) {bad} issued {b['op']} at "
                f"{b['site']} inside a rank-conditional branch ({where}); the others issued {a['op']}",
            )
        if a_cond and not b_cond:
            return diverge(
                "extra collective",
                good,
                f"rank(s) {good} issued {a['op']} at "
                f"{a['site']} inside a rank-conditional branch ({where}); rank(s) {bad} issued {b['op']}",
            )
        return diverge("op mismatch", bad, f"{where}: rank {good[0]} calls {a['op']}, rank(s) {bad} call {b['op']}")
    fields = ("op", "shapes", "dtypes", "reduce_op", "root")
    for key, kind in (
        ("shapes", "shape mismatch"),
        ("dtypes", "dtype mismatch"),
        ("reduce_op", "reduce-op mismatch"),
        ("root", "source mismatch"),
    ):
        if _signature(a)[fields.index(key)] != _signature(b)[fields.index(key)]:
            return diverge(
                kind,
                bad,
                f"{where} {a['op']}: rank {good[0]} {key}={_fmt(a.get(key))}, rank(s) {bad} {key}={_fmt(b.get(key))}",
            )
    raise AssertionError("signatures differ but no field does")  # pragma: no cover


def _fmt(value: Any) -> str:
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
        return "[" + ", ".join(str(tuple(v)) for v in value) + "]"
    return str(list(value) if isinstance(value, tuple) else value)


def _absence(
    states: Mapping[int, Mapping[str, Any]],
    group: str,
    seq: int,
    present: dict[int, dict[str, Any]],
    absent: list[int],
    by_rank: dict[int, dict[int, dict[str, Any]]],
    check: SiteCheck,
    facts: RankFacts,
) -> Divergence:
    """Why ranks ``absent`` have no record at ``seq`` of ``group`` while ranks ``present`` do, in order of
    precedence: a rank crashed, the absent ranks are still busy with the same command (stragglers, see
    :func:`_busy`), or one side issued a collective the other never will (extra or missing)."""
    ref_rank = min(present)
    ref = present[ref_rank]
    sides = [_side(states, ref_rank, ref)] + [_absent_side(states, r, by_rank[r]) for r in absent]
    crashed = _crashed(states, group, seq, present, absent, sides, facts)
    if crashed is not None:
        return crashed
    where = f"group {group} seq {seq}"
    busy = _busy(states, ref, absent, facts)
    if busy and len(busy) == len(absent):
        wait = _age(states[ref_rank], ref)
        return Divergence(
            "straggler",
            busy,
            group,
            seq,
            sides,
            f"rank(s) {busy} have not reached {ref['op']} at "
            f"{ref['site']} ({where}) yet: still running command {ref.get('command')} outside any collective "
            f"while rank(s) {sorted(present)} wait{'' if wait is None else f' {wait:.1f} s'} "
            "(slow, not a desync)",
        )
    command_seq = ref.get("command_seq")
    never, evidence = facts.never(int(command_seq)) if command_seq is not None else (frozenset(), frozenset())
    certain = all(rank in never for rank in absent)
    proof = {"certain": certain, "evidence": sorted(evidence) if certain else []}
    if len(present) < len(absent) or (len(present) == len(absent) and check(str(ref.get("site")))):
        ranks = sorted(present)
        return Divergence(
            "extra collective",
            ranks,
            group,
            seq,
            sides,
            f"rank(s) {ranks} issued {ref['op']} at {ref['site']} ({where}) that rank(s) {absent} never issue",
            **proof,
        )
    return Divergence(
        "missing collective",
        absent,
        group,
        seq,
        sides,
        f"rank(s) {absent} never issued "
        f"{ref['op']} at {ref['site']} ({where}); rank(s) {sorted(present)} wait for them",
        **proof,
    )


def _absent_side(
    states: Mapping[int, Mapping[str, Any]], rank: int, in_group: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """An absent rank's side: its pending call anywhere, else its last record in the group (``in_group``: its
    records there by sequence number), else its last record."""
    records = states[rank].get("records", ())
    pending = [rec for rec in records if rec.get("t_end") is None and not rec.get("from_tail")]
    last_in_group = in_group[max(in_group)] if in_group else None
    return _side(states, rank, pending[-1] if pending else last_in_group or _last(records))


def _crashed(
    states: Mapping[int, Mapping[str, Any]],
    group: str,
    seq: int,
    present: dict[int, dict[str, Any]],
    absent: list[int],
    sides: list[dict[str, Any]],
    facts: RankFacts,
) -> Divergence | None:
    """A 'crashed rank' divergence when an absent rank died, or every rank that issued the call died in it."""
    ref = present[min(present)]
    where = f"group {group} seq {seq}"
    dead = [r for r in absent if states[r].get("crashed")]
    if dead:
        return Divergence(
            "crashed rank",
            dead,
            group,
            seq,
            sides,
            f"rank(s) {dead} died before {ref['op']} at "
            f"{where}; {ref['site']} waits for them ({states[dead[0]].get('detail', '')})",
            certain=all(facts.dead(rank) for rank in dead),
        )
    if all(states[rank].get("crashed") for rank in present):
        # only dead ranks issued it: they died inside it (their tails say so), the others had not arrived yet
        ranks = sorted(present)
        return Divergence(
            "crashed rank",
            ranks,
            group,
            seq,
            sides,
            f"rank(s) {ranks} died in {ref['op']} at {ref['site']} ({where}; "
            f"{states[ranks[0]].get('detail', '')}) before rank(s) {absent} reached it",
            certain=all(facts.dead(rank) for rank in ranks),
        )
    return None


def _busy(
    states: Mapping[int, Mapping[str, Any]], ref: Mapping[str, Any], absent: list[int], facts: RankFacts
) -> list[int]:
    """The absent ranks still running the command the call ``ref`` belongs to, outside any collective, or that
    the command has not reached yet: stragglers, not a desync."""
    command = (ref.get("command"), ref.get("command_seq"))
    command_seq = ref.get("command_seq")

    def blocked_elsewhere(rank: int) -> bool:
        return any(rec.get("t_end") is None for rec in states[rank].get("records", ()))

    return [
        r
        for r in absent
        if (
            (states[r].get("command"), states[r].get("command_seq")) == command
            and states[r].get("command") is not None
            and not blocked_elsewhere(r)
        )
        or (command_seq is not None and facts.not_started(r, int(command_seq)))  # the command has not reached it
    ]


def _summary(states: Mapping[int, Mapping[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for rank in sorted(states):
        state = states[rank]
        pending = [rec for rec in state.get("records", ()) if _pending(rec)]
        records = [rec for rec in state.get("records", ()) if not rec.get("p2p")] or list(state.get("records", ()))
        last = pending[-1] if pending else records[-1] if records else None
        rows.append(
            {
                "rank": rank,
                "state": _rank_state(state),
                "group": None if last is None else last["group"],
                "seq": None if last is None else last["seq"],
                "op": None if last is None else last["op"],
                "site": None if last is None else last.get("site"),
                "age_s": _age(state, last),
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
