"""What the ranks' snapshots prove about the future: which ranks can never issue another call in a command.

The analyser (:mod:`rlsdk.debug.analyze`) calls a divergence *settled* when no future action of any rank can
resolve it. Mismatches at one sequence number are settled by themselves (both calls were issued). A missing,
extra or unmatched call is settled when every rank that would have to issue the counterpart is in the
*never set* of the command ``K`` the waiting call belongs to:

- **dead**: the rank's process is known to have exited (not merely slow to answer);
- **finished**: it runs a later command, or is idle having started ``K`` already (``last_command_seq >= K``;
  idle with an older one means it has not received ``K`` yet: a straggler);
- **blocked for good**: every thread that issued calls in ``K`` (and the main thread) is blocked in a
  synchronous call (``sync``: the issuing function waits before returning, as ``dist.all_reduce`` without
  ``async_op`` does; an ``async_op`` call proves nothing, the thread may still compute), and each such call can
  never complete because a participant that lacks it is itself in the never set, or because another rank
  issued a different call at its sequence number. The set is the greatest fixed point, so wait-for cycles
  (rank 0 in ``recv`` from 1 while 1 waits in an ``all_reduce`` 0 never reaches) count.

"Blocked" rests on snapshots taken at slightly different times on each rank; the live check therefore only
believes it when those ranks' states (:func:`fingerprint`) are unchanged across two polls, which gives one
instant where all of them held at once. Ranks still computing, or blocked in a call some live rank may still
match, are never in the set: that is a straggler or an unsettled hang, left to ``launch.hang_timeout_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ALL_TO_ALL", "RankFacts", "fingerprint", "signature"]

State = Mapping[str, Any]


ALL_TO_ALL = frozenset({"all_to_all_single", "alltoall_base"})
"""Ops whose per-rank input lengths may differ (their split sizes are checked instead)."""


def signature(rec: Mapping[str, Any]) -> tuple[Any, ...]:
    """What two calls at one sequence number must share: op, shapes, dtypes, reduce op and root (all-to-all:
    shapes without their first dimension)."""
    shapes = tuple(map(tuple, rec["shapes"]))
    if rec["op"] in ALL_TO_ALL:
        shapes = tuple(shape[1:] for shape in shapes)
    return (rec["op"], shapes, tuple(rec["dtypes"]), rec.get("reduce_op"), rec.get("root"))


def _pending(rec: Mapping[str, Any]) -> bool:
    return rec.get("t_end") is None and not rec.get("from_tail")


def fingerprint(state: State) -> tuple[Any, ...]:
    """What must stay the same between two polls for a rank's blocked state to be trusted: its record count,
    command and pending calls."""
    records = state.get("records", ())
    pending = tuple((rec["group"], bool(rec.get("p2p")), rec["seq"]) for rec in records if _pending(rec))
    count = state.get("count", len(records))
    return (state.get("crashed", False), count, state.get("command_seq"), pending)


class RankFacts:
    """Per-rank facts over one set of states (see the module docstring).

    Args:
        states: rank -> state, as :func:`rlsdk.debug.analyze.analyze` takes them.
        members: group -> its member ranks present in ``states``.
    """

    def __init__(self, states: Mapping[int, State], members: Callable[[str], list[int]]) -> None:
        self.states = states
        self._members = members
        self._never: dict[int, tuple[frozenset[int], frozenset[int]]] = {}
        self._by_seq: dict[tuple[int, str], dict[int, Mapping[str, Any]]] = {}

    # ---------------------------------------------------------------- single-rank facts

    def dead(self, rank: int) -> bool:
        state = self.states[rank]
        return bool(state.get("crashed")) and bool(state.get("dead"))

    def finished(self, rank: int, command_seq: int) -> bool:
        """The rank runs a later command than ``command_seq``, or is idle after starting it."""
        state = self.states[rank]
        if state.get("crashed"):
            return False
        current = state.get("command_seq")
        if current is not None:
            return int(current) > command_seq
        last = state.get("last_command_seq")
        return last is not None and int(last) >= command_seq

    def not_started(self, rank: int, command_seq: int) -> bool:
        """Idle, and the latest command it started is older than ``command_seq``: it has not received it yet."""
        state = self.states[rank]
        last = state.get("last_command_seq")
        return (
            not state.get("crashed")
            and state.get("command_seq") is None
            and last is not None
            and int(last) < command_seq
        )

    def head(self, rank: int, group: str) -> int | None:
        """The rank's latest collective sequence number in ``group`` (0: none yet; None: unknown)."""
        state = self.states[rank]
        heads = state.get("heads")
        if isinstance(heads, Mapping):
            return int(heads.get(group, 0))
        seqs = [rec["seq"] for rec in state.get("records", ()) if rec["group"] == group and not rec.get("p2p")]
        return max(seqs) if seqs else None

    def lacks(self, rank: int, group: str, seq: int) -> bool:
        """The rank has not issued collective ``seq`` of ``group`` (nor anything after it there)."""
        head = self.head(rank, group)
        return head is None or head < seq

    def record_at(self, rank: int, group: str, seq: int) -> Mapping[str, Any] | None:
        key = (rank, group)
        table = self._by_seq.get(key)
        if table is None:
            table = self._by_seq[key] = {
                rec["seq"]: rec
                for rec in self.states[rank].get("records", ())
                if rec["group"] == group and not rec.get("p2p")
            }
        return table.get(seq)

    def p2p_count(self, rank: int, group: str, op: str, peer: int) -> int:
        """How many ``op`` calls (``send``/``recv``) with ``peer`` the rank issued in ``group``."""
        state = self.states[rank]
        heads = state.get("peer_heads")
        if isinstance(heads, Mapping):
            return int(heads.get(f"{group}|{op}|{peer}", 0))
        counts = [
            int(rec.get("peer_seq") or 0)
            for rec in state.get("records", ())
            if rec["group"] == group and rec.get("p2p") and rec["op"] == op and rec.get("root") == peer
        ]
        return max(counts, default=0)

    def blocked_calls(self, rank: int) -> list[Mapping[str, Any]] | None:
        """The synchronous calls the rank's threads are blocked in, one per thread that issued calls in the
        current command (the main thread always counts); ``None`` when any such thread is not provably blocked
        (still computing, or waiting on an ``async_op`` call it may not have waited for yet)."""
        state = self.states[rank]
        main = state.get("main_thread")
        command_seq = state.get("command_seq")
        if state.get("crashed") or main is None or command_seq is None:
            return None
        alive = state.get("threads")
        latest: dict[Any, Mapping[str, Any]] = {}
        for rec in state.get("records", ()):
            if rec.get("command_seq") == command_seq and rec.get("thread") is not None:
                latest[rec["thread"]] = rec
        threads = {thread for thread in latest if alive is None or str(thread) in alive} | {main}
        calls = []
        for thread in threads:
            rec = latest.get(thread)
            if rec is None or not rec.get("sync") or not _pending(rec):
                return None
            calls.append(rec)
        return calls

    # ---------------------------------------------------------------- the never set

    def never(self, command_seq: int) -> tuple[frozenset[int], frozenset[int]]:
        """``(ranks that never issue another call in command command_seq, the blocked ones among them)``: the
        second set is the evidence a live check must see unchanged on two polls."""
        cached = self._never.get(command_seq)
        if cached is not None:
            return cached
        fixed = {rank for rank in self.states if self.dead(rank) or self.finished(rank, command_seq)}
        blocked: dict[int, list[Mapping[str, Any]]] = {}
        for rank, state in self.states.items():
            if rank in fixed or state.get("command_seq") != command_seq:
                continue
            calls = self.blocked_calls(rank)
            if calls is not None:
                blocked[rank] = calls
        candidates = fixed | set(blocked)
        changed = True
        while changed:
            changed = False
            for rank, calls in blocked.items():
                if rank in candidates and not all(self._doomed(rank, call, candidates) for call in calls):
                    candidates.discard(rank)
                    changed = True
        result = (frozenset(candidates), frozenset(rank for rank in blocked if rank in candidates))
        self._never[command_seq] = result
        return result

    def _doomed(self, owner: int, call: Mapping[str, Any], never: set[int]) -> bool:
        """Whether ``call`` (pending on ``owner``) can never complete, given the ranks in ``never``."""
        group = call["group"]
        if call.get("p2p"):
            peer = call.get("root")
            if call["op"] == "recv_anysource" or peer is None:
                others = [rank for rank in self._members(group) if rank != owner]
                return bool(others) and all(rank in never for rank in others)
            if peer not in self.states:
                return False
            counterpart = "recv" if call["op"] == "send" else "send"
            if call["op"] == "send" and any(
                _pending(rec) and rec["op"] == "recv_anysource" and rec["group"] == group
                for rec in self.states[peer].get("records", ())
            ):
                return False  # an any-source receive on the peer may take it
            issued = self.p2p_count(peer, group, counterpart, owner) >= int(call.get("peer_seq") or 0)
            return not issued and peer in never
        seq = call["seq"]
        for rank in self._members(group):
            if rank == owner:
                continue
            other = self.record_at(rank, group, seq)
            if other is not None and signature(other) != signature(call):
                return True  # a different call at the same sequence number: it never completes normally
            if self.lacks(rank, group, seq) and rank in never:
                return True
        return False
