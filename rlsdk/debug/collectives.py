"""Compare one process group's collectives across its ranks and name the group's first divergence.

Records are aligned by their per-group sequence number. The first sequence number where the ranks disagree is
the group's divergence:

- every rank has the call, but they differ: ``op mismatch`` (or ``extra collective`` when one side's next call
  matches, or when only one side's call site sits in a rank-conditional branch), ``shape mismatch``, ``dtype
  mismatch``, ``reduce-op mismatch``, ``source mismatch`` (broadcast/reduce/gather/scatter root);
- some ranks lack it: ``crashed rank`` (the rank is dead), ``straggler`` (the rank still runs the same command
  and is not inside a collective: slow, not a desync), ``missing collective`` (the rank finished or moved on),
  ``extra collective`` (a minority of ranks issued it, or its call site is rank-conditional).

**Look-alike calls.** Two calls with the same op and tensors pair silently even when the ranks issued them from
different lines: a rank that skips a gradient bucket whose size equals the next one's reduces its next bucket
with the others' skipped one, and only a later call shows the mismatch. Where the call sites first differ
before the group's divergence, the ranks' sequences are compared shifted by one from there (op, tensors and
call site): when one side's calls from there are the other side's from the next one on, that side skipped a
call there, and the skip is reported instead of the later mismatch.

**All-to-all** inputs may differ in length across ranks: their first dimension is left out of the signature,
and the split sizes are checked instead (rank i's input split for j must equal rank j's output split for i):
each disagreement is a pair of ranks, and the rank on every pair is named when there is one
(:func:`rlsdk.debug.rootcause.cover`), else both ranks of the first pair.

**Which side.** The ranks named are the minority of a strict majority of at least two (basis ``majority``);
without one, the side whose call sequence departs from the other ranks' exactly there (``departure``,
:mod:`rlsdk.debug.rootcause`), else the side whose call site sits in a rank-conditional branch (``lint``), else
a convention (``tie``: the side that differs from the lowest rank; an absent side is ``missing``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rlsdk.debug.divergence import Divergence, age, last, make_side, pending
from rlsdk.debug.facts import ALL_TO_ALL, RankFacts, signature
from rlsdk.debug.rootcause import Departure, cover, departs_at, skipped, token

__all__ = ["compare_group"]

States = Mapping[int, Mapping[str, Any]]
ByRank = dict[int, dict[int, dict[str, Any]]]
SiteCheck = Callable[[str], bool]
_FIELDS = ("op", "shapes", "dtypes", "reduce_op", "root")


def compare_group(
    states: States,
    group: str,
    members: list[int],
    check: SiteCheck,
    facts: RankFacts,
    deps: Mapping[int, Departure],
    floor: int = 0,
) -> Divergence | None:
    """The first divergence of ``group``'s collectives among ``members`` after sequence number ``floor``
    (see the module docstring), or ``None``."""
    by_rank: ByRank = {
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
    start = max(lo, floor + 1)
    for seq in range(start, hi + 1):
        present = {rank: seqs[seq] for rank, seqs in by_rank.items() if seq in seqs}
        # absent: has not issued it; a rank past it whose record is not in view (a partial view) is neither
        absent = [rank for rank in members if rank not in present and facts.lacks(rank, group, seq)]
        div: Divergence | None = None
        if len({signature(rec) for rec in present.values()}) > 1:
            div = _mismatch(states, group, seq, present, by_rank, check, deps)
        elif absent and present:
            div = _absence(states, group, seq, present, absent, by_rank, check, facts, deps)
        elif len(present) == len(members) and next(iter(present.values()))["op"] in ALL_TO_ALL:
            div = _split_mismatch(states, group, seq, members, present)
        if div is not None:
            if div.kind in ("crashed rank", "straggler"):
                return div
            return _skipped_call(states, group, by_rank, start, seq, check, deps) or div
    return None


# ---------------------------------------------------------------- which side


def _pick(
    classes: list[list[int]],
    records: Mapping[int, Mapping[str, Any]],
    check: SiteCheck,
    deps: Mapping[int, Departure],
) -> tuple[list[int], list[int], str]:
    """(good ranks, bad ranks, basis) among classes of ranks whose calls at one sequence number agree."""
    ordered = sorted(classes, key=lambda ranks: (-len(ranks), ranks[0]))
    total = sum(len(ranks) for ranks in classes)
    if len(ordered[0]) >= 2 and 2 * len(ordered[0]) > total:
        return ordered[0], sorted(r for ranks in ordered[1:] for r in ranks), "majority"
    if len(classes) == 2:
        x, y = sorted(classes, key=lambda ranks: ranks[0])
        x_dep = all(departs_at(deps, rank, records[rank]) for rank in x)
        y_dep = all(departs_at(deps, rank, records[rank]) for rank in y)
        if x_dep != y_dep:
            return (y, x, "departure") if x_dep else (x, y, "departure")
        x_cond = all(check(str(records[rank].get("site"))) for rank in x)
        y_cond = all(check(str(records[rank].get("site"))) for rank in y)
        if x_cond != y_cond:
            return (y, x, "lint") if x_cond else (x, y, "lint")
    lowest = min(classes, key=lambda ranks: ranks[0])
    return lowest, sorted(r for ranks in classes if ranks is not lowest for r in ranks), "tie"


def _mismatch(
    states: States,
    group: str,
    seq: int,
    present: dict[int, dict[str, Any]],
    by_rank: ByRank,
    check: SiteCheck,
    deps: Mapping[int, Departure],
) -> Divergence:
    """Every rank issued a call at ``seq`` but they differ: settled (nothing can make them match)."""
    classes: dict[tuple[Any, ...], list[int]] = {}
    for rank in sorted(present):
        classes.setdefault(signature(present[rank]), []).append(rank)
    good, bad, basis = _pick(list(classes.values()), present, check, deps)
    a, b = present[good[0]], present[bad[0]]
    sides = [make_side(states, good[0], a)] + [make_side(states, r, present[r]) for r in bad]
    where = f"group {group} seq {seq}"

    def diverge(kind: str, ranks: list[int], message: str) -> Divergence:
        return Divergence(kind, ranks, group, seq, sides, message, settled=True, basis=basis)

    if a["op"] != b["op"]:
        b_next = by_rank[bad[0]].get(seq + 1)
        a_next = by_rank[good[0]].get(seq + 1)
        if b_next is not None and signature(b_next) == signature(a):
            return diverge(
                "extra collective",
                bad,
                f"rank(s) {bad} issued an extra {b['op']} at {b['site']} ({where}) before the {a['op']} the "
                "others issued",
            )
        if a_next is not None and signature(a_next) == signature(b):
            if basis != "tie":  # the others agree on the call: the named ranks skipped it
                return diverge(
                    "missing collective",
                    bad,
                    f"rank(s) {bad} skipped the {a['op']} at {a['site']} ({where}) that rank(s) {good} issued "
                    f"before the {b['op']} they issued there",
                )
            return diverge(
                "extra collective",
                good,
                f"rank(s) {good} issued an extra {a['op']} at {a['site']} ({where}) that rank(s) {bad} did not",
            )
        if basis == "lint":
            return diverge(
                "extra collective",
                bad,
                f"rank(s) {bad} issued {b['op']} at {b['site']} inside a rank-conditional branch ({where}); the "
                f"others issued {a['op']}",
            )
        return diverge("op mismatch", bad, f"{where}: rank {good[0]} calls {a['op']}, rank(s) {bad} call {b['op']}")
    for key, kind in (
        ("shapes", "shape mismatch"),
        ("dtypes", "dtype mismatch"),
        ("reduce_op", "reduce-op mismatch"),
        ("root", "source mismatch"),
    ):
        if signature(a)[_FIELDS.index(key)] != signature(b)[_FIELDS.index(key)]:
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


# ---------------------------------------------------------------- absent calls


def _absence(
    states: States,
    group: str,
    seq: int,
    present: dict[int, dict[str, Any]],
    absent: list[int],
    by_rank: ByRank,
    check: SiteCheck,
    facts: RankFacts,
    deps: Mapping[int, Departure],
) -> Divergence:
    """Why ranks ``absent`` have no record at ``seq`` of ``group`` while ranks ``present`` do, in order of
    precedence: a rank crashed, the absent ranks are still busy with the same command (stragglers, see
    :func:`_busy`), or one side issued a collective the other never will (extra or missing)."""
    ref_rank = min(present)
    ref = present[ref_rank]
    sides = [make_side(states, ref_rank, ref)] + [_absent_side(states, r, by_rank[r]) for r in absent]
    crashed = _crashed(states, group, seq, present, absent, sides, facts)
    if crashed is not None:
        return crashed
    where = f"group {group} seq {seq}"
    busy = _busy(states, ref, absent, facts)
    if busy and len(busy) == len(absent):
        wait = age(states[ref_rank], ref)
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
            basis="slow",
            lacking=busy,
        )
    command_seq = ref.get("command_seq")
    never, evidence = facts.never(int(command_seq)) if command_seq is not None else (frozenset(), frozenset())
    settled = all(rank in never for rank in absent)
    proof: dict[str, Any] = {"settled": settled, "evidence": sorted(evidence) if settled else [], "lacking": absent}
    extra, basis = _extra_or_missing(states, sorted(present), absent, present, check, deps)
    if extra:
        ranks = sorted(present)
        message = f"rank(s) {ranks} issued {ref['op']} at {ref['site']} ({where}) that rank(s) {absent} never issue"
        return Divergence("extra collective", ranks, group, seq, sides, message, basis=basis, **proof)
    message = (
        f"rank(s) {absent} never issued {ref['op']} at {ref['site']} ({where}); rank(s) {sorted(present)} wait for them"
    )
    return Divergence("missing collective", absent, group, seq, sides, message, basis=basis, **proof)


def _extra_or_missing(
    states: States,
    issued: list[int],
    lacking: list[int],
    records: Mapping[int, Mapping[str, Any]],
    check: SiteCheck,
    deps: Mapping[int, Departure],
) -> tuple[bool, str]:
    """(whether the ranks that issued the call have an extra one, basis), for ranks ``issued`` (their calls
    ``records``) against ranks ``lacking`` (which lack it)."""
    if len(issued) >= 2 and len(issued) > len(lacking):
        return False, "majority"
    if len(lacking) >= 2 and len(lacking) > len(issued):
        return True, "majority"
    ref = records[issued[0]]
    if check(str(ref.get("site"))):
        return True, "lint"
    call = token(ref, states[issued[0]], len(states))
    if all(skipped(deps, rank, call) for rank in lacking):
        return False, "departure"
    if all(departs_at(deps, rank, records[rank]) for rank in issued):
        return True, "departure"
    return False, "tie"


def _absent_side(states: States, rank: int, in_group: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """An absent rank's side: its pending call anywhere, else its last record in the group (``in_group``: its
    records there by sequence number), else its last record."""
    records = states[rank].get("records", ())
    waiting = [rec for rec in records if pending(rec)]
    last_in_group = in_group[max(in_group)] if in_group else None
    return make_side(states, rank, waiting[-1] if waiting else last_in_group or last(records))


def _crashed(
    states: States,
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
        gone = all(facts.dead(rank) for rank in dead)
        return Divergence(
            "crashed rank",
            dead,
            group,
            seq,
            sides,
            f"rank(s) {dead} died before {ref['op']} at "
            f"{where}; {ref['site']} waits for them ({states[dead[0]].get('detail', '')})",
            settled=gone,
            basis="dead" if gone else "tie",
            lacking=dead,
        )
    if all(states[rank].get("crashed") for rank in present):
        # only dead ranks issued it: they died inside it (their tails say so), the others had not arrived yet
        ranks = sorted(present)
        gone = all(facts.dead(rank) for rank in ranks)
        return Divergence(
            "crashed rank",
            ranks,
            group,
            seq,
            sides,
            f"rank(s) {ranks} died in {ref['op']} at {ref['site']} ({where}; "
            f"{states[ranks[0]].get('detail', '')}) before rank(s) {absent} reached it",
            settled=gone,
            basis="dead" if gone else "tie",
        )
    return None


def _busy(states: States, ref: Mapping[str, Any], absent: list[int], facts: RankFacts) -> list[int]:
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


# ---------------------------------------------------------------- look-alike calls and all-to-all splits


def _alike(rec: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    return signature(rec) == signature(other) and rec.get("site") == other.get("site")


def _shifted(by_rank: ByRank, short: list[int], long: list[int], seq: int) -> bool:
    """Whether each rank of ``short`` issued from ``seq`` on what ranks ``long`` issued from ``seq + 1`` on."""
    for s in short:
        for g in long:
            compared = 0
            while seq + compared in by_rank[s] and seq + 1 + compared in by_rank[g]:
                if not _alike(by_rank[s][seq + compared], by_rank[g][seq + 1 + compared]):
                    return False
                compared += 1
            if compared == 0:
                return False
    return True


def _skipped_call(
    states: States, group: str, by_rank: ByRank, start: int, end: int, check: SiteCheck, deps: Mapping[int, Departure]
) -> Divergence | None:
    """A call skipped before the group's divergence at ``end`` (see the module docstring), or ``None``."""
    for seq in range(start, end):
        recs = {rank: table[seq] for rank, table in by_rank.items() if seq in table}
        classes: dict[Any, list[int]] = {}
        for rank in sorted(recs):
            classes.setdefault(recs[rank].get("site"), []).append(rank)
        if len(classes) != 2:
            continue  # the same path everywhere, or more than two (no single skip explains those)
        x, y = classes.values()
        x_short, y_short = _shifted(by_rank, x, y, seq), _shifted(by_rank, y, x, seq)
        if x_short == y_short:
            continue  # rank-dependent lines that pair rightly, or a periodic sequence: look further
        short, long = (x, y) if x_short else (y, x)
        return _skip(states, group, seq, recs, short, long, by_rank, check, deps)
    return None


def _skip(
    states: States,
    group: str,
    seq: int,
    recs: dict[int, dict[str, Any]],
    short: list[int],
    long: list[int],
    by_rank: ByRank,
    check: SiteCheck,
    deps: Mapping[int, Departure],
) -> Divergence:
    extra, basis = _extra_or_missing(states, long, short, recs, check, deps)
    skipped_rec, next_rec = recs[long[0]], recs[short[0]]
    sides = [make_side(states, long[0], skipped_rec)] + [make_side(states, r, recs[r]) for r in short]
    where = f"group {group} seq {seq}"
    later = by_rank[long[0]].get(seq + 1)
    shift = (
        f"their seq {seq} is the {next_rec['op']} at {next_rec['site']} that rank(s) {long} issued at seq {seq + 1} "
        f"(same op and tensors: it paired silently with the skipped call), and every later call of theirs in the "
        f"group is one behind"
    )
    if later is None:
        shift = f"their seq {seq} is the {next_rec['op']} at {next_rec['site']}, and their later calls are one behind"
    if extra:
        message = (
            f"rank(s) {long} issued an extra {skipped_rec['op']} at {skipped_rec['site']} ({where}) that rank(s) "
            f"{short} did not issue: " + shift.replace("their", "the others'", 1)
        )
        return Divergence("extra collective", long, group, seq, sides, message, settled=True, basis=basis,
                          lacking=short)  # fmt: skip
    message = f"rank(s) {short} skipped the {skipped_rec['op']} at {skipped_rec['site']} ({where}): " + shift
    return Divergence("missing collective", short, group, seq, sides, message, settled=True, basis=basis,
                      lacking=short)  # fmt: skip


def _split_mismatch(
    states: States, group: str, seq: int, members: list[int], present: dict[int, dict[str, Any]]
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
    pairs = []
    for i, src in enumerate(members):
        for j, dst in enumerate(members):
            sent, expected = splits[src][0], splits[dst][1]
            if len(sent) != size or len(expected) != size or sent[j] == expected[i]:
                continue  # an unknown (even) output split is not checked
            pairs.append((src, dst, f"rank {src} sends {sent[j]} rows to rank {dst} (input_split_sizes {sent}), "
                          f"which expects {expected[i]} from it (output_split_sizes {expected})"))  # fmt: skip
    if not pairs:
        return None
    src, dst, text = pairs[0]
    named = cover((a, b) for a, b, _ in pairs)
    ranks = [named] if named is not None else sorted({src, dst})
    involved = sorted({rank for a, b, _ in pairs for rank in (a, b)}, key=lambda rank: (rank not in ranks, rank))
    op = present[src]["op"]
    message = f"group {group} seq {seq} {op}: {text}"
    if named is not None:
        peers = sorted({b if a == named else a for a, b, _ in pairs} - {named})
        message = (
            f"group {group} seq {seq} {op}: rank {named}'s split sizes disagree with rank(s) {peers}"
            + (" and with themselves" if any(a == b == named for a, b, _ in pairs) else "")
            + f" ({len(pairs)} pairs; the others agree among themselves): {text}"
        )
    return Divergence(
        "shape mismatch",
        ranks,
        group,
        seq,
        [make_side(states, rank, present[rank]) for rank in involved],
        message,
        settled=True,
        basis="cover" if named is not None else "pair",
    )
