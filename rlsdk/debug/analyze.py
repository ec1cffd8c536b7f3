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
"""

from __future__ import annotations

import html
import json
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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
            in the group when it has none) and ``state`` (``waiting``, ``done``, ``idle``, ``busy``, ``crashed``).
        message: one line for humans.
    """

    kind: str
    ranks: list[int]
    group: str
    seq: int
    sides: list[dict[str, Any]]
    message: str


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


def _signature(rec: Mapping[str, Any]) -> tuple[Any, ...]:
    return (
        rec["op"],
        tuple(map(tuple, rec["shapes"])),
        tuple(rec["dtypes"]),
        rec.get("reduce_op"),
        rec.get("root"),
    )


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
    command = f" (command {rec.get('command')} #{rec.get('command_seq')})" if rec.get("command") else ""
    return f"{rec['op']} seq {rec['seq']} shapes=[{shapes}] dtypes=[{dtypes}]{extra} at {rec.get('site')}{command}"


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
) -> TraceReport:
    """Find the first divergence between the ranks' records (see the module docstring).

    Args:
        states: rank -> state (a tracer snapshot, or a crashed-rank entry).
        site_check: ``"file:line" -> bool``: is that call inside a rank-conditional branch? Used to tell an
            extra collective from an op mismatch with two ranks. Default: parse the file with
            :mod:`rlsdk.debug.lint` (``False`` when it cannot be read).
    """
    check = site_check or _default_site_check
    ranks = sorted(states)
    found: list[tuple[float, Divergence]] = []
    p2p_found: list[tuple[float, Divergence]] = []
    for group in sorted({rec["group"] for st in states.values() for rec in st.get("records", ())}):
        members = _members(states, group)
        for div, into in (
            (_compare_group(states, group, members, check), found),
            (_match_p2p(states, group), p2p_found),
        ):
            if div is not None:
                into.append((_first_start(div), div))
    if p2p_found:
        # a rank stuck in a p2p call is absent from the next collective: the p2p divergence is the cause
        stuck_in_p2p = {
            rank
            for rank, st in states.items()
            if any(_pending(rec) and rec.get("p2p") for rec in st.get("records", ()))
        }
        found = [
            item
            for item in found
            if item[1].kind not in _ABSENCE_KINDS or not {side["rank"] for side in item[1].sides} & stuck_in_p2p
        ]
    found += p2p_found
    divergence = min(found, key=lambda item: item[0])[1] if found else None
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
            )
    return TraceReport(divergence, {r: dict(states[r]) for r in ranks}, _summary(states))


_ABSENCE_KINDS = ("missing collective", "extra collective", "straggler")


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
    return bool(state.get("crashed")) or (capacity is not None and len(state.get("records", ())) >= capacity)


def _match_p2p(states: Mapping[int, Mapping[str, Any]], group: str) -> Divergence | None:
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
        div = _p2p_unmatched(states, group, holder, peer, rec)
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
            )
    return None


def _p2p_unmatched(
    states: Mapping[int, Mapping[str, Any]], group: str, holder: int, peer: int, rec: dict[str, Any]
) -> Divergence | None:
    """A call without a counterpart: a divergence unless it is merely in flight (see the module docstring)."""
    sending = rec["op"] == "send"
    what = f"{rec['op']} {'to' if sending else 'from'} rank {peer}" if peer >= 0 else f"{rec['op']} from any rank"
    where = f"group {group}, rank {holder} p2p seq {rec['seq']}" + (
        f", #{rec['peer_seq']} between them" if rec.get("peer_seq") is not None else ""
    )
    if peer < 0:  # an any-source receive no send reaches: every other rank could be the culprit
        others = [rank for rank in sorted(states) if rank != holder]
        if not _pending(rec) or not others:
            return None
        return Divergence(
            "p2p unmatched",
            others,
            group,
            rec["seq"],
            [_side(states, holder, rec)] + [_p2p_peer_side(states, rank) for rank in others],
            f"rank {holder} waits in {what} at {rec.get('site')} ({where}); no rank sends to it",
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
        )
    peer_pending = [r for r in peer_state.get("records", ()) if _pending(r)]
    holder_pending = [r for r in states[holder].get("records", ()) if _pending(r)]
    command = (rec.get("command"), rec.get("command_seq"))
    same_command = (peer_state.get("command"), peer_state.get("command_seq")) == command and command[0] is not None
    if not same_command:
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
    elif not peer_pending and _pending(rec):
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
    return Divergence(
        "p2p unmatched",
        [peer],
        group,
        rec["seq"],
        sides,
        f"rank {holder}'s {what} at {rec.get('site')} ({where}) has no matching {counterpart} on rank {peer}: {detail}",
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
    states: Mapping[int, Mapping[str, Any]], group: str, members: list[int], check: SiteCheck
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
    for seq in range(lo, hi + 1):
        present = {rank: seqs[seq] for rank, seqs in by_rank.items() if seq in seqs}
        absent = [rank for rank in members if rank not in present]
        sigs = Counter(_signature(rec) for rec in present.values())
        if len(sigs) > 1:
            return _mismatch(states, group, seq, present, by_rank, check)
        if absent and present:
            return _absence(states, group, seq, present, absent, by_rank, check)
    return None


def _side(states: Mapping[int, Mapping[str, Any]], rank: int, rec: Mapping[str, Any] | None) -> dict[str, Any]:
    state = states[rank]
    if state.get("crashed"):
        label = "crashed"
    elif rec is not None and rec.get("t_end") is None and not rec.get("from_tail"):
        label = f"waiting {(_age(state, rec) or 0.0):.1f} s"
    else:
        label = _rank_state(state)
    return {"rank": rank, "record": None if rec is None else dict(rec), "state": label}


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
    if a["op"] != b["op"]:
        b_next = by_rank[bad[0]].get(seq + 1)
        a_next = by_rank[good[0]].get(seq + 1)
        if b_next is not None and _signature(b_next) == _signature(a):
            return Divergence(
                "extra collective",
                bad,
                group,
                seq,
                sides,
                f"rank(s) {bad} issued an extra {b['op']} "
                f"at {b['site']} ({where}) before the {a['op']} the others issued",
            )
        if a_next is not None and _signature(a_next) == _signature(b):
            return Divergence(
                "extra collective",
                good,
                group,
                seq,
                sides,
                f"rank(s) {good} issued an extra {a['op']} at {a['site']} ({where}) that rank(s) {bad} did not",
            )
        a_cond, b_cond = check(str(a.get("site"))), check(str(b.get("site")))
        if b_cond and not a_cond:
            return Divergence(
                "extra collective",
                bad,
                group,
                seq,
                sides,
                f"rank(s) {bad} issued {b['op']} at "
                f"{b['site']} inside a rank-conditional branch ({where}); the others issued {a['op']}",
            )
        if a_cond and not b_cond:
            return Divergence(
                "extra collective",
                good,
                group,
                seq,
                sides,
                f"rank(s) {good} issued {a['op']} at "
                f"{a['site']} inside a rank-conditional branch ({where}); rank(s) {bad} issued {b['op']}",
            )
        return Divergence(
            "op mismatch",
            bad,
            group,
            seq,
            sides,
            f"{where}: rank {good[0]} calls {a['op']}, rank(s) {bad} call {b['op']}",
        )
    for key, kind in (
        ("shapes", "shape mismatch"),
        ("dtypes", "dtype mismatch"),
        ("reduce_op", "reduce-op mismatch"),
        ("root", "source mismatch"),
    ):
        if (
            _signature(a)[("op", "shapes", "dtypes", "reduce_op", "root").index(key)]
            != _signature(b)[("op", "shapes", "dtypes", "reduce_op", "root").index(key)]
        ):
            return Divergence(
                kind,
                bad,
                group,
                seq,
                sides,
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
) -> Divergence:
    ref_rank = min(present)
    ref = present[ref_rank]
    where = f"group {group} seq {seq}"

    def last_in_group(rank: int) -> dict[str, Any] | None:
        seqs = by_rank[rank]
        return seqs[max(seqs)] if seqs else None

    def absent_side(rank: int) -> dict[str, Any]:
        records = states[rank].get("records", ())
        pending = [rec for rec in records if rec.get("t_end") is None and not rec.get("from_tail")]
        return _side(states, rank, pending[-1] if pending else last_in_group(rank) or _last(records))

    sides = [_side(states, ref_rank, ref)] + [absent_side(r) for r in absent]
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
        )
    command = (ref.get("command"), ref.get("command_seq"))

    def blocked_elsewhere(rank: int) -> bool:
        return any(rec.get("t_end") is None for rec in states[rank].get("records", ()))

    busy = [
        r
        for r in absent
        if (states[r].get("command"), states[r].get("command_seq")) == command
        and states[r].get("command") is not None
        and not blocked_elsewhere(r)
    ]
    if busy and len(busy) == len(absent):
        wait = _age(states[ref_rank], ref)
        return Divergence(
            "straggler",
            busy,
            group,
            seq,
            sides,
            f"rank(s) {busy} have not reached {ref['op']} at "
            f"{ref['site']} ({where}) yet: still running command {command[0]} outside any collective "
            f"while rank(s) {sorted(present)} wait{'' if wait is None else f' {wait:.1f} s'} "
            "(slow, not a desync)",
        )
    if len(present) < len(absent) or (len(present) == len(absent) and check(str(ref.get("site")))):
        ranks = sorted(present)
        return Divergence(
            "extra collective",
            ranks,
            group,
            seq,
            sides,
            f"rank(s) {ranks} issued {ref['op']} at {ref['site']} ({where}) that rank(s) {absent} never issue",
        )
    return Divergence(
        "missing collective",
        absent,
        group,
        seq,
        sides,
        f"rank(s) {absent} never issued "
        f"{ref['op']} at {ref['site']} ({where}); rank(s) {sorted(present)} wait for them",
    )


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
