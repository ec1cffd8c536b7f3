"""Point-to-point calls: pair each posted send with its receive, and blame the rank the unmatched ones share.

Sends and receives are paired per (sender, receiver) and group, in order: the k-th ``send`` from a to b pairs
with b's k-th ``recv`` from a (the tracer's ``peer_seq``). Pairing rests on the calls each rank *posted*, never
on when they completed: gloo reports a send or receive completed only once it was waited for, and
``batch_isend_irecv`` callers wait in their own order. Any-source receives (``recv_anysource``) are paired
afterwards, by order, with the sends to that rank no explicit receive took (a completed one with the sender the
tracer learned takes that sender's oldest such send first); mixing explicit and any-source receives from one
peer can pair the wrong messages, though the counts stay right.

A pair whose shapes or dtypes differ is a ``shape mismatch`` / ``dtype mismatch`` naming both ranks. A call
without a counterpart is classified alone first: merely in flight (the peer may still post it; not a
divergence), ``straggler`` (the peer still computes), ``crashed rank`` (the peer died), or unmatched (the peer
finished the command, moved to a later one, or waits elsewhere while the caller waits). The unmatched calls of
a group then make one ``p2p unmatched`` divergence: each is an edge between its caller and its peer, and the
rank on every edge is named when there is one with two different peers (a ring where one rank reversed its
send/recv pair: every unmatched call involves that rank; :func:`rlsdk.debug.rootcause.cover`). Otherwise the
rank whose own call sequence departs there (:func:`rlsdk.debug.rootcause.departures`), else the peer lacking
the first unmatched call (a convention: with two ranks either side may be at fault).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlsdk.debug.divergence import (
    Divergence,
    age,
    describe,
    first_start,
    fmt,
    last,
    make_side,
    pending,
)
from rlsdk.debug.facts import RankFacts
from rlsdk.debug.rootcause import Departure, cover

__all__ = ["match_p2p", "truncated"]

States = Mapping[int, Mapping[str, Any]]
_ByPair = dict[tuple[int, int], dict[int, dict[str, Any]]]


@dataclass
class _Unmatched:
    """One posted call without a counterpart that no future call of a live peer is known to match."""

    holder: int
    peer: int  # -1: an any-source receive
    rec: dict[str, Any]
    detail: str
    settled: bool
    evidence: frozenset[int]


def truncated(state: Mapping[str, Any]) -> bool:
    """Older records may be gone: a full ring buffer, or a crashed rank's short tail."""
    capacity = state.get("capacity")
    return (
        bool(state.get("crashed"))
        or bool(state.get("truncated"))
        or (capacity is not None and len(state.get("records", ())) >= capacity)
    )


def match_p2p(states: States, group: str, facts: RankFacts, deps: Mapping[int, Departure]) -> list[Divergence]:
    """The p2p divergences of ``group`` (see the module docstring): every send/recv pair whose tensors differ,
    and one divergence for the calls left without a counterpart (or a straggler / crashed peer)."""
    sends, recvs, anysource = _posted(states, group)
    found: list[Divergence] = []
    loose: list[tuple[int, int, dict[str, Any]]] = []  # (holder, peer or -1 for any source, record)
    for src, dst in sorted(set(sends) | set(recvs)):
        if src not in states or dst not in states:
            continue
        sent, got = sends.get((src, dst), {}), recvs.get((src, dst), {})
        sides = ((src, sent), (dst, got))
        if any(truncated(states[rank]) and not keys for rank, keys in sides):
            # nothing left to compare against; a waiting call on a dead peer is still a crashed rank
            for rank, keys in sides:
                peer = dst if rank == src else src
                loose += [(rank, peer, rec) for rec in keys.values() if pending(rec)]
            continue
        lo = max([min(keys) for rank, keys in sides if truncated(states[rank]) and keys] + [1])
        for k in range(lo, max([*sent, *got]) + 1):
            send, recv = sent.get(k), got.get(k)
            if send is not None and recv is not None:
                found += _mismatch(states, group, src, dst, k, send, recv)
            elif send is not None:
                loose.append((src, dst, send))
            elif recv is not None:
                loose.append((dst, src, recv))
    found += _pair_anysource(states, group, anysource, loose)
    unmatched: list[_Unmatched] = []
    others: list[Divergence] = []
    for holder, peer, rec in sorted(loose, key=lambda item: (item[0], item[2]["seq"])):
        outcome = _classify(states, group, holder, peer, rec, facts)
        if isinstance(outcome, _Unmatched):
            unmatched.append(outcome)
        elif outcome is not None:
            others.append(outcome)
    if unmatched:
        found.append(_unmatched(states, group, unmatched, deps))
    found += [div for div in others if div.kind == "crashed rank"]
    if not unmatched and others:
        found.append(min(others, key=first_start))
    return found


def _posted(states: States, group: str) -> tuple[_ByPair, _ByPair, dict[int, list[dict[str, Any]]]]:
    """Sends and receives by (sender, receiver) and peer_seq, and each rank's any-source receives."""
    sends: _ByPair = {}
    recvs: _ByPair = {}
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
    return sends, recvs, anysource


def _pair_anysource(
    states: States,
    group: str,
    anysource: dict[int, list[dict[str, Any]]],
    loose: list[tuple[int, int, dict[str, Any]]],
) -> list[Divergence]:
    """Any-source receives take the sends no explicit receive took, oldest first (``loose`` is updated)."""
    found: list[Divergence] = []
    for dst, pool in sorted(anysource.items()):
        spare = sorted(
            (item for item in loose if item[2]["op"] == "send" and item[1] == dst), key=lambda i: i[2]["t_start"]
        )
        for recv in sorted(pool, key=lambda rec: rec["t_start"]):
            pick = next((item for item in spare if recv.get("root") in (None, item[0])), None)
            if pick is None:
                loose.append((dst, -1 if recv.get("root") is None else recv["root"], recv))
                continue
            spare.remove(pick)
            loose.remove(pick)
            found += _mismatch(states, group, pick[0], dst, pick[2].get("peer_seq"), pick[2], recv)
    return found


def _mismatch(
    states: States, group: str, src: int, dst: int, k: int | None, send: dict[str, Any], recv: dict[str, Any]
) -> list[Divergence]:
    for key, kind in (("shapes", "shape mismatch"), ("dtypes", "dtype mismatch")):
        a, b = fmt(send.get(key)), fmt(recv.get(key))
        if a != b:
            div = Divergence(
                kind,
                sorted({src, dst}),
                group,
                send["seq"],
                [make_side(states, src, send), make_side(states, dst, recv)],
                f"group {group} p2p #{k} from rank {src} to rank {dst}: send at {send.get('site')} {key}={a} "
                f"(rank {src} p2p seq {send['seq']}), recv at {recv.get('site')} {key}={b} "
                f"(rank {dst} p2p seq {recv['seq']})",
                settled=True,
                basis="pair",
            )
            return [div]
    return []


def _classify(
    states: States, group: str, holder: int, peer: int, rec: dict[str, Any], facts: RankFacts
) -> _Unmatched | Divergence | None:
    """One call without a counterpart: ``None`` when it is merely in flight, a straggler or crashed-rank
    divergence, or an :class:`_Unmatched` call."""
    command_seq = rec.get("command_seq")
    never, evidence = facts.never(int(command_seq)) if command_seq is not None else (frozenset(), frozenset())
    sending = rec["op"] == "send"
    what = f"{rec['op']} {'to' if sending else 'from'} rank {peer}" if peer >= 0 else f"{rec['op']} from any rank"
    where = f"group {group}, rank {holder} p2p seq {rec['seq']}" + (
        f", #{rec['peer_seq']} between them" if rec.get("peer_seq") is not None else ""
    )
    if peer < 0:  # an any-source receive no send reaches: every other rank could be the culprit
        others = [rank for rank in sorted(states) if rank != holder]
        if not pending(rec) or not others:
            return None
        settled = all(rank in never for rank in others)
        return _Unmatched(holder, peer, rec, f"rank {holder} waits in {what} at {rec.get('site')} ({where}); no "
                          "rank sends to it", settled, evidence if settled else frozenset())  # fmt: skip
    peer_state = states[peer]
    sides = [make_side(states, holder, rec), _peer_side(states, peer)]
    counterpart = "recv" if sending else "send"
    if peer_state.get("crashed"):
        dead = facts.dead(peer)
        return Divergence(
            "crashed rank",
            [peer],
            group,
            rec["seq"],
            sides,
            f"rank {peer} died before the {counterpart} matching rank {holder}'s {what} at {rec.get('site')} "
            f"({where}; {peer_state.get('detail', '')})",
            settled=dead,
            basis="dead" if dead else "tie",
            lacking=[peer],
        )
    peer_pending = [r for r in peer_state.get("records", ()) if pending(r)]
    holder_pending = [r for r in states[holder].get("records", ()) if pending(r)]
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
        detail = f"rank {peer} is stuck in {describe(stuck)}"
    elif (not peer_pending or not_started) and pending(rec):
        wait = age(states[holder], rec)
        return Divergence(
            "straggler",
            [peer],
            group,
            rec["seq"],
            sides,
            f"rank {peer} has not reached the {counterpart} matching rank {holder}'s {what} at {rec.get('site')} "
            f"({where}) yet: still running command {command[0]} outside any collective while rank {holder} waits"
            f"{'' if wait is None else f' {wait:.1f} s'} (slow, not a desync)",
            basis="slow",
            lacking=[peer],
        )
    else:
        return None  # in flight: the peer may still post it
    settled = peer in never
    message = f"rank {holder}'s {what} at {rec.get('site')} ({where}) has no matching {counterpart} on rank {peer}: "
    return _Unmatched(holder, peer, rec, message + detail, settled, evidence if settled else frozenset())


def _unmatched(states: States, group: str, calls: list[_Unmatched], deps: Mapping[int, Departure]) -> Divergence:
    """One divergence for a group's unmatched calls, naming the rank they share (see the module docstring)."""
    edges = [(call.holder, call.peer) for call in calls if call.peer >= 0]
    named = cover(edges)
    basis = "cover" if named is not None else "tie"
    if named is None:
        involved = sorted({rank for edge in edges for rank in edge})
        own = {rank: {int(c.rec.get("index", -1)) for c in calls if c.holder == rank} for rank in involved}
        backed = [rank for rank in involved if rank in deps and deps[rank].index in own[rank]]
        if len(backed) == 1:
            named, basis = backed[0], "departure"
    first = calls[0]
    ranks = [named] if named is not None else ([first.peer] if first.peer >= 0 else _others(states, first.holder))
    mine = [call for call in calls if call.holder in ranks]
    lead = mine[0] if mine and named is not None else first
    sides = [make_side(states, lead.holder, lead.rec)]
    for call in calls:
        if call.holder not in {item["rank"] for item in sides}:
            sides.append(make_side(states, call.holder, call.rec))
    for rank in ranks:
        if rank not in {item["rank"] for item in sides}:
            sides.append(_peer_side(states, rank))
    settled = all(call.settled for call in calls)
    evidence = sorted(set().union(*(call.evidence for call in calls))) if settled else []
    message = first.detail if len(calls) == 1 else _summary(ranks, calls, basis)
    lacking = sorted({call.peer for call in calls if call.peer >= 0} or set(ranks))
    return Divergence(
        "p2p unmatched",
        ranks,
        group,
        lead.rec["seq"],
        sides,
        message,
        settled=settled,
        evidence=evidence,
        basis=basis,
        lacking=lacking,
    )


def _summary(ranks: list[int], calls: list[_Unmatched], basis: str) -> str:
    def short(call: _Unmatched) -> str:
        rec = call.rec
        arrow = f"{'to' if rec['op'] == 'send' else 'from'} rank {call.peer}" if call.peer >= 0 else "from any rank"
        return f"rank {call.holder} {rec['op']} {arrow} (#{rec.get('peer_seq')}, p2p seq {rec['seq']})"

    lead = (
        f"rank {ranks[0]} is on every one of the {len(calls)} posted send/recv calls of group {calls[0].rec['group']} "
        "left without a counterpart"
        if basis == "cover"
        else f"{len(calls)} posted send/recv calls of group {calls[0].rec['group']} have no counterpart"
    )
    return f"{lead}: {', '.join(short(call) for call in calls)}; {calls[0].detail}"


def _others(states: States, holder: int) -> list[int]:
    return [rank for rank in sorted(states) if rank != holder]


def _peer_side(states: States, rank: int) -> dict[str, Any]:
    records = states[rank].get("records", ())
    waiting = [rec for rec in records if pending(rec)]
    return make_side(states, rank, waiting[-1] if waiting else last(records))
