"""Which divergences are settled (reported by the live check at once) and which are left to hang_timeout_s; which
verdicts are certain (their ranks named from evidence alone) and which only lead ranked candidates; the history
of a divergence. Pure functions over records (no processes)."""

from __future__ import annotations

from typing import Any

import pytest

from rlsdk.debug.analyze import analyze
from rlsdk.debug.facts import RankFacts

MAIN, HELPER = 100, 200


def rec(seq: int, op: str = "allreduce", *, group: str = "0", shape: tuple[int, ...] = (4,), dtype: str = "float32",
        reduce_op: str | None = "SUM", root: int | None = None, site: str = "train.py:10", done: bool = True,
        sync: bool = True, thread: int = MAIN, command_seq: int = 3, t: float = 0.0,
        splits: Any = None) -> dict[str, Any]:  # fmt: skip
    return {
        "group": group, "seq": seq, "p2p": False, "op": op, "shapes": [list(shape)], "dtypes": [dtype],
        "reduce_op": reduce_op if op in ("allreduce", "reduce") else None, "root": root, "command": "update",
        "command_seq": command_seq, "site": site, "stack": [f"{site} in step"], "t_start": 100.0 + seq + t,
        "t_end": None if not done else 101.0 + seq, "peer_seq": None, "splits": splits, "sync": sync,
        "thread": thread, "index": seq,
    }  # fmt: skip


def p2p(seq: int, op: str, peer: int, peer_seq: int, **kwargs: Any) -> dict[str, Any]:
    return rec(seq, op, root=peer, **kwargs) | {"p2p": True, "peer_seq": peer_seq, "reduce_op": None}


def state(rank: int, *records: dict[str, Any], command_seq: int | None = 3, last: int | None = None,
          ranks: tuple[int, ...] = (0, 1), groups: dict[str, Any] | None = None,
          threads: tuple[int, ...] = (MAIN,)) -> dict[str, Any]:  # fmt: skip
    collectives = [r for r in records if not r["p2p"]]
    heads: dict[str, int] = {}
    for r in collectives:
        heads[r["group"]] = max(heads.get(r["group"], 0), r["seq"])
    peer_heads: dict[str, int] = {}
    for r in records:
        if r["p2p"]:
            key = f"{r['group']}|{r['op']}|{r['root']}"
            peer_heads[key] = max(peer_heads.get(key, 0), r["peer_seq"])
    return {
        "rank": rank, "now": 130.0, "command": "update" if command_seq is not None else None,
        "command_seq": command_seq, "last_command_seq": command_seq if last is None else last,
        "groups": groups or {"0": {"ranks": list(ranks)}}, "records": list(records), "heads": heads,
        "peer_heads": peer_heads, "main_thread": MAIN, "threads": {str(t): f"t{t}" for t in threads},
    }  # fmt: skip


def never(site: str) -> bool:
    return False


def diagnose(states: dict[int, dict[str, Any]]) -> Any:
    div = analyze(states, site_check=never).divergence
    assert div is not None
    return div


@pytest.mark.parametrize(
    ("second", "kind"),
    [
        (rec(2, "broadcast", root=0, done=False), "op mismatch"),
        (rec(2, shape=(5,), done=False), "shape mismatch"),
        (rec(2, dtype="float64", done=False), "dtype mismatch"),
        (rec(2, reduce_op="MAX"), "reduce-op mismatch"),
    ],
)
def test_mismatch_at_one_sequence_number_is_settled_without_evidence_but_a_two_rank_tie_is_not_certain(
    second: dict[str, Any], kind: str
) -> None:
    states = {0: state(0, rec(1), rec(2, done=False)), 1: state(1, rec(1), second)}

    div = diagnose(states)

    assert (div.kind, div.settled, div.evidence, div.certain, div.basis) == (kind, True, [], False, "tie")
    assert (div.candidates[0]["kind"], div.candidates[0]["ranks"]) == (kind, [1])


@pytest.mark.parametrize(
    ("second", "kind"),
    [(rec(2, shape=(5,), done=False), "shape mismatch"), (rec(2, reduce_op="MAX"), "reduce-op mismatch")],
)
def test_mismatch_against_a_strict_majority_names_the_minority_as_certain(second: dict[str, Any], kind: str) -> None:
    ranks = (0, 1, 2)
    states = {r: state(r, rec(1), rec(2, done=False), ranks=ranks) for r in (0, 2)}
    states[1] = state(1, rec(1), second, ranks=ranks)

    div = diagnose(states)

    assert (div.kind, div.ranks, div.settled, div.certain, div.basis) == (kind, [1], True, True, "majority")
    assert "certain: a strict majority" in str(analyze(states, site_check=never))


def test_source_mismatch_is_certain() -> None:
    states = {
        0: state(0, rec(1, "broadcast", root=0, done=False)),
        1: state(1, rec(1, "broadcast", root=1, done=False)),
    }

    assert (diagnose(states).kind, diagnose(states).settled) == ("source mismatch", True)


def test_missing_collective_whose_lagging_rank_finished_the_command_is_settled() -> None:
    states = {0: state(0, rec(1), rec(2, done=False)), 1: state(1, rec(1), command_seq=None, last=3)}

    div = diagnose(states)

    assert (div.kind, div.ranks, div.settled, div.certain) == ("missing collective", [1], True, False)
    assert "not certain (no evidence picks a side" in str(analyze(states, site_check=never))


def test_missing_collective_on_a_minority_that_finished_the_command_is_certain() -> None:
    ranks = (0, 1, 2)
    states = {r: state(r, rec(1), rec(2, done=False), ranks=ranks) for r in (0, 1)}
    states[2] = state(2, rec(1), command_seq=None, last=3, ranks=ranks)

    div = diagnose(states)

    assert (div.kind, div.ranks, div.certain, div.basis, div.evidence) == (
        "missing collective", [2], True, "majority", [0, 1]
    )  # fmt: skip


def test_missing_collective_whose_lagging_rank_moved_to_a_later_command_is_settled() -> None:
    states = {0: state(0, rec(1), rec(2, done=False)), 1: state(1, rec(1), command_seq=4)}

    assert diagnose(states).settled


def test_idle_rank_that_has_not_received_the_command_yet_is_a_straggler_not_certain() -> None:
    states = {0: state(0, rec(1), rec(2, done=False)), 1: state(1, rec(1, command_seq=2), command_seq=None, last=2)}

    div = diagnose(states)

    assert (div.kind, div.ranks, div.certain) == ("straggler", [1], False)


def test_rank_still_computing_is_a_straggler_never_certain() -> None:
    states = {0: state(0, rec(1), rec(2, done=False)), 1: state(1, rec(1))}

    div = diagnose(states)

    assert (div.kind, div.certain) == ("straggler", False)


def test_rank_stuck_in_its_tp_group_is_explained_by_that_group_not_reported_missing_from_the_dp_group() -> None:
    groups = {"1": {"ranks": [1, 2]}, "2": {"ranks": [0, 1]}}  # "1": tensor parallel, "2": data parallel
    states = {
        0: state(0, rec(1, group="2", done=False, site="dp.py:8", t=2.0), groups=groups),
        1: state(1, rec(1, group="1", done=False, site="tp.py:5"), groups=groups),
        2: state(2, command_seq=None, last=3, groups=groups),  # skipped the TP all-reduce and finished
    }

    div = diagnose(states)

    assert (div.kind, div.group, div.ranks, div.settled) == ("missing collective", "1", [2], True)
    assert [(c["group"], c["ranks"]) for c in div.candidates] == [("1", [2]), ("2", [1])]
    assert (
        "explained: rank(s) [1] wait in, or broke in, missing collective in group 1 seq 1" in div.candidates[1]["why"]
    )


def test_never_set_holds_finished_ranks_and_ranks_blocked_on_them_with_the_blocked_ones_as_evidence() -> None:
    groups = {"1": {"ranks": [1, 2]}, "2": {"ranks": [0, 1]}}
    states = {
        0: state(0, rec(1, group="2", done=False, t=2.0), groups=groups),
        1: state(1, rec(1, group="1", done=False), groups=groups),
        2: state(2, command_seq=None, last=3, groups=groups),
    }
    facts = RankFacts(states, lambda group: groups[group]["ranks"])

    never, evidence = facts.never(3)

    assert (set(never), set(evidence)) == ({0, 1, 2}, {0, 1})


def test_absent_rank_blocked_in_a_call_a_computing_rank_may_still_join_is_not_certain() -> None:
    groups = {"0": {"ranks": [0, 1, 2]}, "1": {"ranks": [1, 2]}}
    states = {
        0: state(0, rec(1), rec(2, done=False), groups=groups),
        1: state(1, rec(1), rec(1, group="1", done=False), groups=groups),
        2: state(2, rec(1), rec(2, done=False), groups=groups),
    }
    states[2]["records"][-1]["t_end"] = 103.0  # rank 2 is back computing: it may still issue group 1's call

    div = diagnose(states)

    assert not div.certain


def test_async_pending_call_proves_nothing() -> None:
    states = {
        0: state(0, rec(1), p2p(1, "recv", 1, 1, done=False, t=1.0)),
        1: state(1, rec(1), rec(2, done=False, sync=False)),
    }

    div = diagnose(states)

    assert div.kind == "p2p unmatched" and not div.certain


def test_wait_for_cycle_of_blocked_ranks_is_settled_with_both_as_evidence_but_not_certain() -> None:
    states = {
        0: state(0, rec(1), p2p(1, "recv", 1, 1, done=False, t=1.0)),
        1: state(1, rec(1), rec(2, done=False)),
    }

    div = diagnose(states)

    assert (div.kind, div.ranks, div.settled, div.evidence, div.certain) == ("p2p unmatched", [1], True, [0, 1], False)
    assert [(c["kind"], c["ranks"]) for c in div.candidates] == [("p2p unmatched", [1]), ("missing collective", [0])]
    assert "convention" in div.candidates[0]["why"]  # either rank may be at fault: rank 1 never sends, or rank 0
    # should have joined the all-reduce


def test_irecv_in_the_cycle_leaves_it_uncertain() -> None:
    states = {
        0: state(0, rec(1), p2p(1, "recv", 1, 1, done=False, t=1.0, sync=False)),
        1: state(1, rec(1), rec(2, done=False)),
    }

    assert not diagnose(states).certain


def test_blocked_main_thread_with_a_live_helper_thread_that_issued_calls_is_not_provably_blocked() -> None:
    states = {
        0: state(0, rec(1), p2p(1, "recv", 1, 1, done=False, t=1.0), threads=(MAIN, HELPER)),
        1: state(1, rec(1), rec(2, done=False)),
    }
    states[0]["records"].insert(1, p2p(1, "send", 1, 1, thread=HELPER) | {"seq": 0})

    assert not diagnose(states).certain


def test_unmatched_send_to_a_finished_peer_is_certain() -> None:
    states = {
        0: state(0, p2p(1, "send", 1, 1), p2p(2, "send", 1, 2, done=False)),
        1: state(1, p2p(1, "recv", 0, 1), command_seq=None, last=3),
    }

    div = diagnose(states)

    assert (div.kind, div.settled) == ("p2p unmatched", True)


def test_crashed_rank_is_certain_only_when_its_process_is_known_gone() -> None:
    base = {0: state(0, rec(1), rec(2, done=False))}
    silent = base | {1: {"rank": 1, "crashed": True, "detail": "no answer within 1 s", "records": [rec(1)]}}
    dead = base | {1: {"rank": 1, "crashed": True, "dead": True, "detail": "exit code -9", "records": [rec(1)]}}

    assert (diagnose(silent).kind, diagnose(silent).certain) == ("crashed rank", False)
    assert (diagnose(dead).kind, diagnose(dead).certain) == ("crashed rank", True)


def test_uneven_all_to_all_with_consistent_splits_agrees() -> None:
    states = {
        0: state(0, rec(1, "all_to_all_single", shape=(3,), reduce_op=None, splits=[[1, 2], [1, 3]])),
        1: state(1, rec(1, "all_to_all_single", shape=(5,), reduce_op=None, splits=[[3, 2], [2, 2]])),
    }

    assert analyze(states, site_check=never).ok


def test_all_to_all_with_mismatched_splits_is_a_certain_shape_mismatch_naming_both_ranks() -> None:
    states = {
        0: state(0, rec(1, "all_to_all_single", shape=(4,), reduce_op=None, splits=[[1, 3], [1, 3]])),
        1: state(1, rec(1, "all_to_all_single", shape=(4,), reduce_op=None, splits=[[2, 2], [2, 2]])),
    }

    div = diagnose(states)

    assert (div.kind, div.ranks, div.certain) == ("shape mismatch", [0, 1], True)
    assert "sends 3 rows to rank 1" in div.message and "expects 2" in div.message


def test_rank_whose_group_records_left_its_ring_buffer_is_not_absent() -> None:
    groups = {"0": {"ranks": [0, 1]}, "1": {"ranks": [0, 1]}}
    states = {
        0: state(0, rec(7, group="1"), *(rec(s) for s in range(1, 4)), groups=groups),
        1: state(1, *(rec(s) for s in range(1, 4)), groups=groups),
    }
    states[1]["heads"]["1"] = 7  # issued it; the record left rank 1's buffer

    assert analyze(states, site_check=never).ok


def test_history_names_the_first_sequence_number_whose_call_sites_differ_and_the_last_clean_collective() -> None:
    clean = [rec(s, site="loop.py:5") for s in range(1, 201)]
    states = {
        0: state(0, *clean, rec(201, site="loop.py:5"), rec(202, site="loop.py:5"), rec(203, done=False)),
        1: state(1, *clean, rec(201, site="nan_guard.py:9"), rec(202, site="loop.py:5"), rec(203, shape=(2,))),
    }

    div = diagnose(states)
    text = str(analyze(states, site_check=never))

    assert (div.kind, div.seq) == ("shape mismatch", 203)
    assert div.history is not None
    first, last = div.history["first_difference"], div.history["last_agreed"]
    assert (first["seq"], first["sites"]) == (201, {0: "loop.py:5", 1: "nan_guard.py:9"})
    assert (first["command"], first["command_seq"]) == ("update", 3)
    assert last["seq"] == 200 and last["site"] == "loop.py:5"
    assert (
        "first differ at group 0 seq 201" in text and "last collective every rank agrees on: allreduce seq 200" in text
    )


def test_headline_says_where_the_ranks_diverged() -> None:
    states = {0: state(0, rec(1), rec(2, done=False, site="probe.py:3")), 1: state(1, rec(1), command_seq=None)}

    line = diagnose(states).headline()

    assert line.startswith("diverged at group 0 seq 2: missing collective on rank(s) [1]")
    assert "allreduce at probe.py:3" in line and "command update #3" in line


def test_acknowledged_divergence_is_skipped_so_the_next_one_is_found() -> None:
    states = {
        0: state(0, rec(1), rec(2, reduce_op="SUM"), rec(3), rec(4, done=False)),
        1: state(1, rec(1), rec(2, reduce_op="MAX"), rec(3), rec(4, shape=(2,))),
    }

    first = diagnose(states)
    after = analyze(states, site_check=never, acknowledged={"0": 2}).divergence

    assert (first.kind, first.seq) == ("reduce-op mismatch", 2)
    assert after is not None and (after.kind, after.seq) == ("shape mismatch", 4)
