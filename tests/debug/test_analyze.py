"""The analyser names the first divergence and its kind from per-rank records (no processes)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rlsdk.debug.analyze import KINDS, analyze, load_report, to_flight_recorder


def rec(seq: int, op: str = "allreduce", *, shape: tuple[int, ...] = (4,), dtype: str = "float32",
        reduce_op: str | None = "SUM", root: int | None = None, site: str = "train.py:10",
        done: bool = True, group: str = "0", t: float = 0.0) -> dict[str, Any]:  # fmt: skip
    return {
        "group": group, "seq": seq, "p2p": False, "op": op, "shapes": [list(shape)], "dtypes": [dtype],
        "reduce_op": reduce_op if op in ("allreduce", "reduce") else None, "root": root, "command": "update",
        "command_seq": 3, "site": site, "stack": [f"{site} in step"], "t_start": 100.0 + seq + t,
        "t_end": 101.0 + seq if done else None,
    }  # fmt: skip


def state(rank: int, *records: dict[str, Any], command: str | None = "update", now: float = 120.0) -> dict[str, Any]:
    return {"rank": rank, "now": now, "command": command, "command_seq": 3 if command else None,
            "groups": {"0": {"ranks": [0, 1]}}, "records": list(records)}  # fmt: skip


def never(site: str) -> bool:
    return False


def test_analyze_when_ranks_agree_reports_no_divergence() -> None:
    report = analyze({0: state(0, rec(1), rec(2)), 1: state(1, rec(1), rec(2))}, site_check=never)

    assert report.ok and "agree" in str(report)


@pytest.mark.parametrize(
    ("second", "kind", "field"),
    [
        (rec(2, "broadcast", root=0, done=False), "op mismatch", "broadcast"),
        (rec(2, shape=(5,), done=False), "shape mismatch", "(5,)"),
        (rec(2, dtype="float64", done=False), "dtype mismatch", "float64"),
        (rec(2, reduce_op="MAX"), "reduce-op mismatch", "MAX"),
    ],
)
def test_analyze_when_rank1_differs_at_seq2_reports_kind_rank_seq_and_both_sides(
    second: dict[str, Any], kind: str, field: str
) -> None:
    states = {0: state(0, rec(1), rec(2, done=False)), 1: state(1, rec(1), second)}

    div = analyze(states, site_check=never).divergence

    assert div is not None
    assert (div.kind, div.ranks, div.group, div.seq) == (kind, [1], "0", 2)
    assert [side["rank"] for side in div.sides] == [0, 1]
    assert field in div.message
    assert div.sides[1]["record"]["site"] == "train.py:10"


def test_analyze_when_broadcast_sources_differ_reports_source_mismatch() -> None:
    states = {
        0: state(0, rec(1, "broadcast", root=0, done=False)),
        1: state(1, rec(1, "broadcast", root=1, done=False)),
    }

    div = analyze(states, site_check=never).divergence

    assert div is not None and div.kind == "source mismatch" and "root=1" in div.message


def test_analyze_when_lagging_rank_is_idle_reports_missing_collective() -> None:
    states = {0: state(0, rec(1), rec(2, done=False)), 1: state(1, rec(1), command=None)}

    div = analyze(states, site_check=never).divergence

    assert div is not None and (div.kind, div.ranks, div.seq) == ("missing collective", [1], 2)


def test_analyze_when_lagging_rank_still_computes_reports_straggler_not_desync() -> None:
    states = {0: state(0, rec(1), rec(2, done=False)), 1: state(1, rec(1))}

    div = analyze(states, site_check=never).divergence

    assert div is not None and (div.kind, div.ranks) == ("straggler", [1])
    assert "not a desync" in div.message


def test_analyze_when_only_rank0_calls_under_rank_condition_reports_extra_collective() -> None:
    states = {
        0: state(0, rec(1), rec(2, "broadcast", root=0, site="train.py:20", done=False)),
        1: state(1, rec(1), rec(2, site="train.py:21", done=False)),
    }

    div = analyze(states, site_check=lambda site: site == "train.py:20").divergence

    assert div is not None and (div.kind, div.ranks, div.seq) == ("extra collective", [0], 2)
    assert {side["record"]["site"] for side in div.sides} == {"train.py:20", "train.py:21"}


def test_analyze_when_next_call_matches_reports_extra_collective_by_lookahead() -> None:
    states = {
        0: state(0, rec(1), rec(2), rec(3, done=False)),
        1: state(1, rec(1), rec(2, "barrier", reduce_op=None), rec(3, done=False)),
    }

    div = analyze(states, site_check=never).divergence

    assert div is not None and (div.kind, div.ranks) == ("extra collective", [1])


def test_analyze_when_minority_issued_a_call_others_never_did_reports_extra_collective() -> None:
    groups = {"0": {"ranks": [0, 1, 2]}}
    states = {r: state(r, rec(1), command=None) | {"groups": groups} for r in (1, 2)}
    states[0] = state(0, rec(1), rec(2, done=False)) | {"groups": groups}

    div = analyze(states, site_check=never).divergence

    assert div is not None and (div.kind, div.ranks) == ("extra collective", [0])


def test_analyze_when_a_rank_is_dead_reports_crashed_rank() -> None:
    states = {0: state(0, rec(1), rec(2, done=False)), 1: {"rank": 1, "crashed": True, "detail": "exit code 9",
                                                          "records": [rec(1)]}}  # fmt: skip

    div = analyze(states, site_check=never).divergence

    assert div is not None and (div.kind, div.ranks) == ("crashed rank", [1])
    assert "exit code 9" in div.message


def test_analyze_uses_majority_on_four_ranks_and_names_the_odd_rank() -> None:
    groups = {"0": {"ranks": [0, 1, 2, 3]}}
    states = {r: state(r, rec(1), rec(2, done=False)) | {"groups": groups} for r in range(4)}
    states[2] = state(2, rec(1), rec(2, shape=(3,), done=False)) | {"groups": groups}

    div = analyze(states, site_check=never).divergence

    assert div is not None and (div.kind, div.ranks) == ("shape mismatch", [2])


def test_analyze_compares_only_the_window_every_ring_buffer_still_holds() -> None:
    states = {0: state(0, *(rec(s) for s in range(5, 9))), 1: state(1, *(rec(s) for s in range(1, 9)))}

    assert analyze(states, site_check=never).ok


def test_analyze_every_kind_is_documented() -> None:
    assert len(KINDS) == 10


def test_report_views_text_html_flight_recorder_and_reload(tmp_path) -> None:
    states = {0: state(0, rec(1), rec(2, done=False)), 1: state(1, rec(1), command=None)}
    report = analyze(states, site_check=never)

    text, page = str(report), report._repr_html_()
    for rank, item in states.items():
        (tmp_path / f"rank_{rank}.json").write_text(json.dumps(item))
    again = load_report(tmp_path)
    fr = to_flight_recorder(states[0])

    assert "missing collective" in text and "train.py:10" in text
    assert "<table>" in page and "background" in page
    assert again.divergence is not None and again.divergence.kind == "missing collective"
    assert [e["collective_seq_id"] for e in fr["entries"]] == [1, 2]
    assert fr["entries"][1]["state"] == "scheduled" and fr["entries"][0]["profiling_name"] == "gloo:all_reduce"
    assert fr["entries"][0]["frames"][0] == {"name": "step", "filename": "train.py", "line": 10}
    json.dumps(report.to_dict())


def test_trace_show_cli_prints_the_divergence_and_exports_for_the_flight_recorder_analyser(tmp_path) -> None:
    import subprocess
    import sys

    from rlsdk.cli import main
    from rlsdk.debug.watchdog import save_report

    states = {
        0: state(0, rec(1), rec(2, "broadcast", root=0, done=False)),
        1: state(1, rec(1), rec(2, done=False)),
    }
    save_report(analyze(states, site_check=never), tmp_path / "out" / "traces" / "20260101-000000-update")

    code = main(["trace", "show", str(tmp_path / "out"), "--flight-recorder", str(tmp_path / "fr")])
    fr = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", "-p", "rank_", str(tmp_path / "fr")],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert code == 1
    assert fr.returncode == 0, fr.stderr
    assert "COLLECTIVE_TYPE_MISMATCH" in fr.stdout + fr.stderr and "Culprit rank 1" in fr.stdout + fr.stderr


def p2p(
    seq: int, op: str, peer: int | None, peer_seq: int | None, *, shape: tuple[int, ...] = (4,),
    dtype: str = "float32", site: str = "pp.py:5", done: bool = True, t: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    item = rec(seq, op, shape=shape, dtype=dtype, root=peer, site=site, done=done, t=t)
    return item | {"p2p": True, "peer_seq": peer_seq}


def test_analyze_when_sends_and_recvs_pair_up_reports_no_divergence() -> None:
    states = {
        0: state(0, *(p2p(k, "send", 1, k) for k in range(1, 4)), rec(1, t=5.0)),
        1: state(1, *(p2p(k, "recv", 0, k) for k in range(1, 4)), rec(1, t=5.0)),
    }

    assert analyze(states, site_check=never).ok


def test_analyze_when_send_has_no_recv_and_peer_finished_reports_p2p_unmatched_naming_both_ranks() -> None:
    states = {
        0: state(0, p2p(1, "send", 1, 1), p2p(2, "send", 1, 2, site="pp.py:9", done=False)),
        1: state(1, p2p(1, "recv", 0, 1), command=None),
    }

    div = analyze(states, site_check=never).divergence

    assert div is not None and (div.kind, div.ranks, div.seq) == ("p2p unmatched", [1], 2)
    assert [side["rank"] for side in div.sides] == [0, 1] and div.sides[0]["record"]["site"] == "pp.py:9"
    assert "rank 0" in div.message and "rank 1" in div.message and "pp.py:9" in div.message


def test_analyze_when_rank0_waits_in_recv_while_rank1_waits_in_all_reduce_reports_the_p2p_cause() -> None:
    states = {
        0: state(0, rec(1), p2p(1, "recv", 1, 1, site="pp.py:7", done=False, t=1.0)),
        1: state(1, rec(1), rec(2, site="train.py:30", done=False)),
    }

    div = analyze(states, site_check=never).divergence

    assert div is not None and (div.kind, div.ranks, div.seq) == ("p2p unmatched", [1], 1)
    assert {side["record"]["site"] for side in div.sides} == {"pp.py:7", "train.py:30"}
    assert "allreduce seq 2" in div.message


def test_analyze_when_peer_still_computes_reports_p2p_straggler_and_in_flight_send_is_not_a_divergence() -> None:
    waiting = {0: state(0, p2p(1, "send", 1, 1, done=False)), 1: state(1)}
    in_flight = {0: state(0, p2p(1, "send", 1, 1)), 1: state(1)}  # completed on rank 0, recv not recorded yet

    div = analyze(waiting, site_check=never).divergence

    assert div is not None and (div.kind, div.ranks) == ("straggler", [1])
    assert analyze(in_flight, site_check=never).ok


@pytest.mark.parametrize(
    ("recv", "kind"), [({"shape": (6,)}, "shape mismatch"), ({"dtype": "int64"}, "dtype mismatch")]
)
def test_analyze_when_send_and_recv_tensors_differ_reports_mismatch_with_both_call_sites(
    recv: dict[str, Any], kind: str
) -> None:
    states = {
        0: state(0, p2p(1, "send", 1, 1, site="a.py:1")),
        1: state(1, p2p(1, "recv", 0, 1, site="b.py:2", **recv)),
    }

    div = analyze(states, site_check=never).divergence

    assert div is not None and (div.kind, div.ranks, div.seq) == (kind, [0, 1], 1)
    assert "a.py:1" in div.message and "b.py:2" in div.message


def test_analyze_pairs_any_source_receives_by_order_and_with_the_learned_sender() -> None:
    groups = {"0": {"ranks": [0, 1, 2]}}
    states = {
        0: state(0, p2p(1, "send", 2, 1, t=0.1)) | {"groups": groups},
        1: state(1, p2p(1, "send", 2, 1, shape=(8,), t=0.2)) | {"groups": groups},
        2: state(2, p2p(1, "recv_anysource", 1, None, shape=(8,)), p2p(2, "recv_anysource", None, None, t=1.0))
        | {"groups": groups},
    }

    assert analyze(states, site_check=never).ok
    states[2]["records"].pop()  # rank 0's send is left without a receive; rank 2 finished
    states[2]["command"] = None
    div = analyze(states, site_check=never).divergence
    assert div is not None and (div.kind, div.ranks, div.sides[0]["rank"]) == ("p2p unmatched", [2], 0)


def test_analyze_pairs_p2p_only_in_the_window_every_ring_buffer_still_holds() -> None:
    full = state(0, *(p2p(k, "send", 1, k) for k in range(5, 9))) | {"capacity": 4}
    states = {0: full, 1: state(1, *(p2p(k, "recv", 0, k) for k in range(1, 9)))}

    assert analyze(states, site_check=never).ok
