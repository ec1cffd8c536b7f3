"""The root cause across groups, p2p blame from posted calls, and skips caught by call site: on traces recorded from
real 4-rank gloo runs of ``_faults.ROOT_CAUSE_PATTERNS`` (``tests/debug/traces/``, written by
``benchmarks/root_cause_soak.py --save-traces``) and on small synthetic traces. No processes."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import _faults
import pytest

from rlsdk.debug.analyze import analyze
from rlsdk.debug.divergence import Divergence
from rlsdk.debug.rootcause import cover, departures, sink_components

TRACES = Path(__file__).parent / "traces"
PATTERNS = sorted(_faults.ROOT_CAUSE_PATTERNS)


def recorded(name: str) -> dict[int, dict[str, Any]]:
    return {int(rank): state for rank, state in json.loads((TRACES / f"{name}.json").read_text()).items()}


def never(site: str) -> bool:
    return False


def verdict(states: dict[int, dict[str, Any]]) -> tuple[Any, ...] | None:
    div = analyze(states, site_check=never).divergence
    if div is None:
        return None
    group = next(
        (st["groups"][div.group]["ranks"] for st in states.values() if div.group in (st.get("groups") or {})),
        sorted(r for r, st in states.items() if any(rec["group"] == div.group for rec in st["records"])),
    )
    sites = {side["record"]["site"] for side in div.sides if side.get("record")}
    return (div.kind, div.ranks, group, div.seq, div.certain, sites)


@pytest.mark.parametrize("name", PATTERNS)
def test_recorded_pattern_names_the_root_cause_its_ranks_and_call_sites(name: str) -> None:
    expected = _faults.ROOT_CAUSE_PATTERNS[name]

    found = verdict(recorded(name))

    if expected is None:
        assert found is None, found
        return
    kind, ranks, group, seq, markers, certain = expected
    assert found is not None
    assert found[:5] == (kind, ranks, group, seq, certain), found
    assert {f"_faults.py:{marker}" for marker in markers} <= found[5], found


@pytest.mark.parametrize("name", PATTERNS)
def test_recorded_pattern_verdict_does_not_depend_on_timing(name: str) -> None:
    states = recorded(name)
    shuffled = copy.deepcopy(states)
    rng = random.Random(name)
    for state in shuffled.values():  # each rank's clock and completion polling drift differently
        offset = rng.uniform(-5.0, 5.0)
        for rec in state["records"]:
            rec["t_start"] += offset
            if rec.get("t_end") is not None:
                rec["t_end"] += offset
        if "now" in state:
            state["now"] += offset

    assert verdict(shuffled) == verdict(states)


def test_mesh_cycle_report_blames_the_rank_whose_sequence_departs_and_lists_the_explained_groups() -> None:
    report = analyze(recorded("mesh_tp_skip_cycle"), site_check=never)

    div = report.divergence
    text = str(report)
    assert div is not None and div.settled and div.evidence == [0, 1, 2, 3]
    assert [(c["kind"], c["ranks"]) for c in div.candidates] == [
        ("missing collective", [3]),  # TP{2,3}: the cycle broken where rank 3 departs
        ("missing collective", [0, 2]),  # the world barrier: ranks 0 and 2 wait elsewhere
        ("missing collective", [2]),  # DP{0,2}: rank 2 waits in TP{2,3}
    ]
    assert "depart" in div.candidates[0]["why"] and "explained" in div.candidates[1]["why"]
    assert "certain: the named ranks' own call sequences depart" in text


def test_ring_blame_rests_on_posted_calls_not_on_which_ones_completed() -> None:
    states = recorded("p2p_ring_reversed_pair")
    flipped = copy.deepcopy(states)
    matched = {(0, "send", 1), (0, "recv", 3), (1, "recv", 0), (3, "send", 0)}  # the last round's paired calls
    for rank, state in flipped.items():  # gloo reports a p2p call completed only once waited for: vary it
        for rec in state["records"]:
            if rec["p2p"] and rec["peer_seq"] == 3 and (rank, rec["op"], rec["root"]) in matched:
                rec["t_end"] = None if rec["t_end"] is not None else rec["t_start"] + 0.001

    for view in (states, flipped):
        div = analyze(view, site_check=never).divergence
        assert div is not None and (div.kind, div.ranks, div.basis, div.certain) == (
            "p2p unmatched",
            [2],
            "cover",
            False,
        )
        assert "rank 2 is on every one of the 4 posted send/recv calls" in div.message


def test_uncertain_report_lists_ranked_candidates_with_why() -> None:
    text = str(analyze(recorded("p2p_ring_reversed_pair"), site_check=never))

    assert "not certain (it may still resolve); candidates, best first:" in text
    assert "1. p2p unmatched on rank(s) [2]" in text and "2. extra collective on rank(s) [0]" in text
    assert "explained: rank(s) [1, 2, 3] wait in, or broke in, p2p unmatched in group 0 seq 5" in text


# ---------------------------------------------------------------- synthetic traces


def rec(seq: int, *, site: str, shape: int = 4, group: str = "0", done: bool = True, index: int | None = None,
        op: str = "allreduce", command_seq: int = 3) -> dict[str, Any]:  # fmt: skip
    return {
        "group": group, "seq": seq, "p2p": False, "op": op, "shapes": [[shape]], "dtypes": ["float32"],
        "reduce_op": "SUM" if op == "allreduce" else None, "root": None, "command": "update",
        "command_seq": command_seq, "site": site, "stack": [site], "t_start": 100.0 + seq, "t_end": 101.0 + seq if done
        else None, "peer_seq": None, "splits": None, "sync": True, "thread": 1, "index": seq if index is None else
        index,
    }  # fmt: skip


def state(rank: int, *records: dict[str, Any], ranks: tuple[int, ...] = (0, 1), finished: bool = False) -> dict:
    heads: dict[str, int] = {}
    for r in records:
        heads[r["group"]] = max(heads.get(r["group"], 0), r["seq"])
    return {
        "rank": rank, "now": 200.0, "command": None if finished else "update", "command_seq": None if finished else 3,
        "last_command_seq": 3, "groups": {"0": {"ranks": list(ranks)}}, "records": list(records), "heads": heads,
        "peer_heads": {}, "main_thread": 1, "threads": {"1": "MainThread"},
    }  # fmt: skip


def buckets(skip: bool, *, steps: int = 2) -> list[dict[str, Any]]:
    """Per step: head (4), attn (16), mlp (16), embed (8); ``skip``: the last step has no attn bucket."""
    out: list[dict[str, Any]] = []
    for step in range(steps):
        for name, shape in (("head", 4), ("attn", 16), ("mlp", 16), ("embed", 8)):
            if skip and step == steps - 1 and name == "attn":
                continue
            out.append(rec(len(out) + 1, site=f"ddp.py:{name}", shape=shape))
    out[-1]["t_end"] = None  # waits in its last call
    return out


@pytest.mark.parametrize(("world", "certain"), [(2, False), (3, True)])
def test_skipped_bucket_of_equal_size_is_named_at_the_skip_not_at_the_later_mismatch(world: int, certain: bool) -> None:
    ranks = tuple(range(world))
    states = {rank: state(rank, *buckets(skip=rank == 1), ranks=ranks) for rank in ranks}

    div = analyze(states, site_check=never).divergence

    assert div is not None and (div.kind, div.ranks, div.seq, div.certain) == ("missing collective", [1], 6, certain)
    assert {side["record"]["site"] for side in div.sides} == {"ddp.py:attn", "ddp.py:mlp"}
    assert "paired silently" in div.message


def test_rank_dependent_call_sites_that_pair_rightly_are_not_a_divergence() -> None:
    states = {
        rank: state(rank, *(rec(s, site=f"log_{rank}.py:{s % 2}") for s in range(1, 9)), finished=True)
        for rank in (0, 1)
    }

    assert analyze(states, site_check=never).ok


def test_differing_call_sites_that_no_shift_explains_leave_the_later_mismatch() -> None:
    r0 = [rec(1, site="a.py:1"), rec(2, site="step.py:5", shape=8), rec(3, site="step.py:5", shape=8)]
    r1 = [rec(1, site="a.py:1"), rec(2, site="other.py:9", shape=8), rec(3, site="flag.py:2", shape=1)]

    div = analyze({0: state(0, *r0), 1: state(1, *r1)}, site_check=never).divergence

    assert div is not None and (div.kind, div.seq) == ("shape mismatch", 3)


def test_departures_name_the_rank_whose_sequence_leaves_the_majority_and_what_it_skipped() -> None:
    common = [rec(1, site="warm.py:1"), rec(1, site="tp.py:2", group="1", index=2), rec(2, site="tp.py:3", group="1")]
    states = {rank: state(rank, *common, ranks=(0, 1, 2, 3)) for rank in (0, 1, 2)}
    states[3] = state(3, common[0], common[1], rec(2, site="dp.py:4", group="2", index=3), ranks=(0, 1, 2, 3))
    for index, item in enumerate(common):
        item["index"] = index

    found = departures(states)

    assert set(found) == {3}
    assert (found[3].position, found[3].agreeing, found[3].voters) == (1, 3, 4)
    assert found[3].majority[1] == "tp.py:3" and found[3].token[1] == "dp.py:4"


def test_two_ranks_never_depart_from_each_other() -> None:
    states = {rank: state(rank, rec(1, site="a.py:1"), rec(2, site=f"b{rank}.py:1")) for rank in (0, 1)}

    assert departures(states) == {}


@pytest.mark.parametrize(
    ("edges", "named"),
    [
        ([(1, 2), (2, 1), (2, 3), (3, 2)], 2),  # a ring where rank 2 reversed its pair
        ([(0, 1)], None),  # one pair: either side
        ([(0, 1), (1, 0)], None),  # still one pair of ranks
        ([(1, 1), (0, 1)], 1),  # a rank at odds with itself (its own split sizes)
        ([(0, 1), (2, 3)], None),  # two independent pairs
        ([], None),
    ],
)
def test_cover_names_the_one_rank_on_every_unmatched_pair(edges: list[tuple[int, int]], named: int | None) -> None:
    assert cover(edges) == named


def test_sink_components_find_cycles_that_nothing_leaves() -> None:
    # 0 -> 1 -> 2 -> 0 is a cycle with nothing leaving; 3 -> 0 leaves into it; 4 is alone
    edges = {0: {1}, 1: {2}, 2: {0}, 3: {0}}

    assert sink_components(5, edges) == [[0, 1, 2], [4]]


def test_certain_implies_settled_for_divergences_built_by_hand() -> None:
    div = Divergence("op mismatch", [1], "0", 2, [], "built elsewhere", certain=True)

    assert div.settled
