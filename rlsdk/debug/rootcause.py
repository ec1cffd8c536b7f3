"""Which of the divergences found in each group is the root cause, and how sure the analyser may be of it.

Each group yields at most one divergence for its collectives and one for its point-to-point calls. One hang
shows in several groups: in a TP{0,1}{2,3} x DP{0,2}{1,3} mesh where rank 3 skips a TP all-reduce, rank 2
waits in TP{2,3} for rank 3, rank 0 in DP{0,2} for rank 2, and ranks 1 and 3 in the world barrier for ranks 0
and 2. Three groups diverge; one of them is the cause.

**Who waits on whom.** A divergence *lacks* ranks: those that never issued the call the others wait in (its
``lacking``; a mismatch lacks none, every rank issued its call). A lacking rank is *held* by another divergence
when it waits in one of that divergence's calls, or took part in a mismatch there (its collective broke: it
may have raised or died since). A divergence whose lacking ranks are all held by others is *explained* by them
(an edge of the wait-for graph); one that is not is a root. When every divergence is explained the waits form a
cycle (the mesh above: TP{2,3} waits on rank 3, which waits in the world barrier on rank 2, which waits in
TP{2,3}), and the graph's sink components hold the candidates.

**Whose call sequence departs.** Ranks of one program issue the same calls in the same order, whatever their
groups: rank 3 of the mesh issued (all-reduce at the TP site, at the DP site, ...) where ranks 0, 1 and 2
issued a third all-reduce at the skipped TP site first. :func:`departures` compares the ranks' call sequences
position by position after the latest collective every rank issued alike in WORLD (the *anchor*), each call a
token (op, shapes, dtypes, reduce op, root, call site; a send/recv's peer relative to the rank), and finds the
first position where a rank's token differs from a strict majority of at least two ranks. A candidate is
*backed* when its named ranks depart exactly there: a lacking rank where the majority issued the call the
others wait in, an issuing rank at its own call. A cycle is broken by the one backed candidate; with none or
several, by a convention (mismatches and crashes first, then p2p, then absences; then the earliest call), and
the verdict is not certain.

**Blame from posted calls.** Unmatched or mismatched pairs (a send without its receive, an all-to-all split one
side does not expect) are edges between two ranks; :func:`cover` names the one rank on every edge, when there is
one with at least two different peers (or a rank at odds with itself).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlsdk.debug.divergence import FORCED_BASES, Divergence, first_start, pending
from rlsdk.debug.facts import signature

__all__ = [
    "Departure",
    "cover",
    "departs_at",
    "departures",
    "is_backed",
    "root_cause",
    "sink_components",
    "skipped",
    "token",
]

WORLD = "0"
_MISMATCHES = frozenset({"op mismatch", "shape mismatch", "dtype mismatch", "reduce-op mismatch", "source mismatch"})


@dataclass(frozen=True)
class Departure:
    """Where a rank's call sequence first departs from the majority's.

    Attributes:
        rank: the rank.
        position: calls after the anchor before it.
        index: the rank's record ``index`` there (its own call at the departure).
        token: the rank's token there.
        majority: the majority's token there (the call the rank did not make).
        agreeing: how many ranks issued the majority's token; ``voters``: how many had a call there.
        example: a majority rank's record there.
    """

    rank: int
    position: int
    index: int
    token: tuple[Any, ...]
    majority: tuple[Any, ...]
    agreeing: int
    voters: int
    example: Mapping[str, Any]


def token(rec: Mapping[str, Any], state: Mapping[str, Any], world: int) -> tuple[Any, ...]:
    """What two ranks' calls at one position of their sequences share in one program (see the module
    docstring): a collective's signature and call site; a send/recv's op, shapes, dtypes, call site and its
    peer relative to the rank in the group (``peer - rank`` mod the group size)."""
    if not rec.get("p2p"):
        return (signature(rec), rec.get("site"))
    info = (state.get("groups") or {}).get(rec["group"]) or {}
    size = info.get("size") or (world if rec["group"] == WORLD else None)
    me = info.get("rank", state.get("rank") if rec["group"] == WORLD else None)
    peer = rec.get("root")
    relative = None if peer is None or size is None or me is None else (int(peer) - int(me)) % int(size)
    shapes = tuple(map(tuple, rec["shapes"]))
    return ("p2p", rec["op"], relative, shapes, tuple(rec["dtypes"]), rec.get("site"))


def _main_records(state: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The main thread's records in issue order (other threads interleave by timing, not by program order)."""
    main = state.get("main_thread")
    records = [rec for rec in state.get("records", ()) if main is None or rec.get("thread") in (None, main)]
    return sorted(records, key=lambda rec: rec.get("index", 0))


def _anchor(states: Mapping[int, Mapping[str, Any]]) -> dict[int, int]:
    """rank -> the index of its anchor record: the latest WORLD collective issued alike by the most ranks. With
    no WORLD collective, index -1 for ranks whose window starts at their first record; else no anchor."""
    issued: dict[int, dict[int, Mapping[str, Any]]] = {}
    for rank, state in states.items():
        for rec in _main_records(state):
            if rec["group"] == WORLD and not rec.get("p2p"):
                issued.setdefault(int(rec["seq"]), {})[rank] = rec
    best: tuple[int, int] | None = None
    for seq, recs in issued.items():
        alike = len({(signature(rec), rec.get("site")) for rec in recs.values()}) == 1
        if alike and len(recs) >= 2 and (best is None or (len(recs), seq) > best):
            best = (len(recs), seq)
    if best is not None:
        return {rank: int(rec.get("index", 0)) for rank, rec in issued[best[1]].items()}
    whole = {
        rank: -1
        for rank, state in states.items()
        if state.get("records") and min(int(rec.get("index", 0)) for rec in state["records"]) == 0
    }
    return whole if len(whole) == len(states) else {}


def departures(states: Mapping[int, Mapping[str, Any]]) -> dict[int, Departure]:
    """rank -> its first departure from the majority's call sequence (see the module docstring); ranks that
    never depart, or have no anchor, are absent."""
    anchors = _anchor(states)
    world = len(states)
    sequences = {
        rank: [rec for rec in _main_records(states[rank]) if int(rec.get("index", 0)) > anchor]
        for rank, anchor in anchors.items()
    }
    tokens = {rank: [token(rec, states[rank], world) for rec in recs] for rank, recs in sequences.items()}
    found: dict[int, Departure] = {}
    longest = max((len(seq) for seq in tokens.values()), default=0)
    for position in range(longest):
        voters = {rank: seq[position] for rank, seq in tokens.items() if rank not in found and position < len(seq)}
        if len(voters) < 3:
            break  # two ranks never make a strict majority of at least two against a third
        top, agreeing = Counter(voters.values()).most_common(1)[0]
        if agreeing < 2 or 2 * agreeing <= len(voters):
            continue
        example = next(sequences[rank][position] for rank, tok in voters.items() if tok == top)
        for rank, tok in voters.items():
            if tok != top:
                rec = sequences[rank][position]
                found[rank] = Departure(
                    rank, position, int(rec.get("index", 0)), tok, top, agreeing, len(voters), example
                )
    return found


def departs_at(deps: Mapping[int, Departure], rank: int, rec: Mapping[str, Any] | None) -> bool:
    """Whether ``rank``'s call sequence departs from the majority's at its own call ``rec``."""
    dep = deps.get(rank)
    return dep is not None and rec is not None and int(rec.get("index", -1)) == dep.index


def skipped(deps: Mapping[int, Departure], rank: int, call: tuple[Any, ...]) -> bool:
    """Whether ``rank``'s call sequence departs from the majority's where the majority issued the call whose
    token is ``call`` (the rank did not make it there)."""
    dep = deps.get(rank)
    return dep is not None and dep.majority == call


def cover(edges: Iterable[tuple[int, int]]) -> int | None:
    """The one rank on every edge (an unmatched or mismatched pair), when it has at least two different peers
    or an edge to itself; else ``None`` (a single pair: either side could be at fault)."""
    pairs = list(edges)
    if not pairs:
        return None
    common = set.intersection(*({a, b} for a, b in pairs))
    if len(common) != 1:
        return None
    (rank,) = common
    peers = {b if a == rank else a for a, b in pairs}
    return rank if any(a == b for a, b in pairs) or len(peers - {rank}) >= 2 else None


def sink_components(size: int, edges: Mapping[int, set[int]]) -> list[list[int]]:
    """Strongly connected components of the graph on ``range(size)`` that no edge leaves, each sorted, in
    order of their smallest node (Tarjan's algorithm, iterative)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    stack: list[int] = []
    on_stack: set[int] = set()
    components: list[list[int]] = []
    counter = 0
    for start in range(size):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                components.append(sorted(component))
    of = {node: i for i, component in enumerate(components) for node in component}
    sinks = [c for i, c in enumerate(components) if all(of[t] == i for n in c for t in edges.get(n, ()))]
    return sorted(sinks, key=lambda component: component[0])


def _own_record(div: Divergence, rank: int) -> Mapping[str, Any] | None:
    for item in div.sides:
        rec = item.get("record")
        if item["rank"] == rank and rec is not None:
            p2p = bool(rec.get("p2p"))
            if p2p or (rec["group"], rec["seq"]) == (div.group, div.seq):
                return rec
    return None


def _call(div: Divergence) -> tuple[int, Mapping[str, Any]] | None:
    """(rank, record) of the call the lacking ranks did not make: an issuing side's record at the divergence."""
    for item in div.sides:
        rec = item.get("record")
        if rec is not None and item["rank"] not in div.lacking and (rec.get("p2p") or rec["seq"] == div.seq):
            return item["rank"], rec
    return None


def is_backed(
    div: Divergence, ranks: Sequence[int], states: Mapping[int, Mapping[str, Any]], deps: Mapping[int, Departure]
) -> bool:
    """Whether every rank of ``ranks`` departs exactly at ``div``: a rank lacking a collective where the majority
    issued the call the others wait in, any other at its own call there (a send/recv: its first unmatched one)."""
    if not ranks:
        return False
    call = _call(div)
    p2p = bool(div.sides and (div.sides[0].get("record") or {}).get("p2p"))
    for rank in ranks:
        if rank in div.lacking and not p2p:
            if call is None or not skipped(deps, rank, token(call[1], states[call[0]], len(states))):
                return False
        elif not departs_at(deps, rank, _own_record(div, rank)):
            return False
    return True


def _held(states: Mapping[int, Mapping[str, Any]], div: Divergence) -> set[int]:
    """Ranks waiting in one of the divergence's calls, or whose collective broke in it (a mismatch)."""
    held: set[int] = set()
    p2p = any((item.get("record") or {}).get("p2p") for item in div.sides[:1])
    for rank, state in states.items():
        for rec in state.get("records", ()):
            if rec["group"] != div.group or bool(rec.get("p2p")) != p2p:
                continue
            if p2p:
                if pending(rec) and rank in {item["rank"] for item in div.sides}:
                    held.add(rank)
            elif rec["seq"] == div.seq and (pending(rec) or div.kind in _MISMATCHES):
                held.add(rank)
    return held


def _priority(div: Divergence) -> int:
    if div.kind in _MISMATCHES or div.kind == "crashed rank":
        return 0
    return 1 if div.kind == "p2p unmatched" else 2


def _explanations(states: Mapping[int, Mapping[str, Any]], found: Sequence[Divergence]) -> dict[int, set[int]]:
    """i -> the divergences holding every lacking rank of divergence i (empty: i is not explained)."""
    held = [_held(states, div) for div in found]
    edges: dict[int, set[int]] = {}
    for i, div in enumerate(found):
        holders = {rank: {j for j in range(len(found)) if j != i and rank in held[j]} for rank in div.lacking}
        if div.lacking and all(holders.values()):
            edges[i] = set().union(*holders.values())
    return edges


def root_cause(
    states: Mapping[int, Mapping[str, Any]], found: Sequence[Divergence], deps: Mapping[int, Departure]
) -> Divergence | None:
    """The divergence to report among ``found`` (see the module docstring), with ``certain`` and ``candidates``
    set."""
    if not found:
        return None
    edges = _explanations(states, found)
    backed = {i for i, div in enumerate(found) if is_backed(div, div.ranks, states, deps)}
    roots: dict[int, str] = {}  # index -> how it was picked: "root", "departure" or "convention"
    for component in sink_components(len(found), edges):
        if len(component) == 1:
            roots[component[0]] = "root"
            continue
        picks = [i for i in component if i in backed]
        if len(picks) == 1:
            roots[picks[0]] = "departure"
        else:
            pool = picks or component
            roots[min(pool, key=lambda i: (_priority(found[i]), first_start(found[i])))] = "convention"

    def rank_key(i: int) -> tuple[Any, ...]:
        div = found[i]
        return (not div.settled, i not in backed, roots.get(i) == "convention", first_start(div), i)

    chosen_index = min(roots, key=rank_key)
    chosen = found[chosen_index]
    chosen.certain = chosen.settled and chosen.basis in FORCED_BASES and roots[chosen_index] != "convention"
    order = sorted(roots, key=rank_key) + sorted((i for i in range(len(found)) if i not in roots), key=rank_key)
    chosen.candidates = [_candidate(found, i, roots.get(i), edges.get(i, set()), i in backed) for i in order]
    return chosen


def _candidate(found: Sequence[Divergence], i: int, picked: str | None, by: set[int], backed: bool) -> dict[str, Any]:
    div = found[i]
    if picked is None:
        names = "; ".join(f"{found[j].kind} in group {found[j].group} seq {found[j].seq}" for j in sorted(by))
        why = f"explained: rank(s) {div.lacking} wait in, or broke in, {names}"
    elif picked == "root":
        why = "not explained by another divergence's waits"
    elif picked == "departure":
        why = "a wait-for cycle, broken here: the named ranks' call sequences depart from the majority's here"
    else:
        why = "a wait-for cycle that no departing call sequence breaks: picked by convention"
    if backed and picked != "departure":
        why += "; the named ranks' call sequences depart from the majority's here"
    return {
        "kind": div.kind,
        "ranks": list(div.ranks),
        "group": div.group,
        "seq": div.seq,
        "site": div.site(),
        "settled": div.settled,
        "basis": div.basis,
        "why": why,
    }
