"""Injected collective faults on real traced gloo ranks are diagnosed live (kind, rank, seq, call sites).

The process-group timeout stays at torch's default (30 min): every diagnosis comes from the ranks' event
threads answering while their main threads are stuck, and the harness kills every rank afterwards.
"""

from __future__ import annotations

from pathlib import Path

import _faults
import psutil
import pytest

from rlsdk.debug.harness import diagnose

pytestmark = pytest.mark.distributed

FAULTS = Path(_faults.__file__)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def site(marker: str) -> str:
    for number, line in enumerate(FAULTS.read_text().splitlines(), start=1):
        if f"# {marker}" in line:
            return f"{FAULTS}:{number}"
    raise AssertionError(marker)


CASES = [
    # (scenario, kind, faulty ranks, seq, call sites that must appear among the sides)
    ("skipped_all_reduce", "missing collective", [1], 3, ["SKIPPED_SITE"]),
    ("extra_under_rank0", "extra collective", [0], 2, ["EXTRA_SITE", "COMMON_SITE"]),
    ("all_reduce_vs_broadcast", "op mismatch", [1], 2, ["OP_SITE"]),
    ("shape_mismatch", "shape mismatch", [1], 2, ["SHAPE_SITE"]),
    ("gather_uneven", "shape mismatch", [1], 2, ["GATHER_SITE"]),
    ("dtype_mismatch", "dtype mismatch", [1], 2, ["DTYPE_SITE"]),
    ("sum_vs_max", "reduce-op mismatch", [1], 2, ["REDUCE_SITE"]),
    ("broadcast_sources", "source mismatch", [1], 2, ["SRC_SITE"]),
    ("crashed_rank", "crashed rank", [1], 2, ["CRASH_SITE"]),
    ("straggler", "straggler", [1], 2, ["STRAGGLER_SITE"]),
    ("only_main_process", "extra collective", [0], 2, ["MAIN_ONLY_SITE"]),
    ("ddp_unused_parameter", "shape mismatch", [1], 4, ["DDP_BACKWARD_SITE", "DDP_NEXT_SITE"]),
    # point-to-point: seq is the p2p sequence number on the first side's rank
    ("send_never_received", "p2p unmatched", [1], 1, ["UNRECEIVED_SEND_SITE", "AFTER_SEND_SITE"]),
    ("recv_never_sent", "p2p unmatched", [1], 1, ["UNSENT_RECV_SITE"]),
    ("recv_while_peer_reduces", "p2p unmatched", [1], 1, ["RECV_VS_REDUCE_SITE", "REDUCE_VS_RECV_SITE"]),
    ("p2p_recv_too_small", "shape mismatch", [0, 1], 1, ["P2P_SEND_SITE", "P2P_RECV_SITE"]),
    ("p2p_recv_too_large", "shape mismatch", [0, 1], 1, ["P2P_SMALL_SEND_SITE", "P2P_LARGE_RECV_SITE"]),
]


@pytest.mark.parametrize(("scenario", "kind", "ranks", "seq", "sites"), CASES, ids=[case[0] for case in CASES])
def test_fault_on_two_ranks_is_diagnosed_within_10s_of_the_diverging_call(
    scenario: str, kind: str, ranks: list[int], seq: int, sites: list[str]
) -> None:
    result = diagnose(getattr(_faults, scenario), 2)

    div = result.report.divergence
    assert div is not None, str(result.report)
    assert (div.kind, div.ranks, div.group, div.seq) == (kind, ranks, "0", seq), str(result.report)
    seen = {side["record"]["site"] for side in div.sides if side.get("record")}
    assert {site(marker) for marker in sites} <= seen, str(result.report)
    assert result.latency_s is None or result.latency_s < 10.0  # None: the lagging side never issued it
    assert site(sites[0]) in str(result.report)
    assert len(result.pids) == 2 and not any(alive(pid) for pid in result.pids)


def test_clean_ping_pong_of_fifty_send_recv_pairs_gives_no_divergence() -> None:
    result = diagnose(_faults.ping_pong, 2, within_s=2.0)

    assert result.report.ok, str(result.report)
    for state in result.report.states.values():
        p2p = [rec for rec in state["records"] if rec["p2p"]]
        assert len(p2p) == 100 and all(rec["t_end"] is not None for rec in p2p)
        assert [rec["peer_seq"] for rec in p2p if rec["op"] == "send"] == list(range(1, 51))


@pytest.mark.slow  # ~7 s each: 4 ranks on 2 shared cores
@pytest.mark.parametrize(
    ("scenario", "kind", "ranks", "seq"),
    [("skipped_all_reduce", "missing collective", [3], 3), ("crashed_rank", "crashed rank", [3], 2)],
)
def test_fault_on_four_ranks_names_the_odd_rank(scenario: str, kind: str, ranks: list[int], seq: int) -> None:
    result = diagnose(getattr(_faults, scenario), 4)

    div = result.report.divergence
    assert div is not None, str(result.report)
    assert (div.kind, div.ranks, div.seq) == (kind, ranks, seq), str(result.report)
    assert result.latency_s is None or result.latency_s < 10.0
    assert not any(alive(pid) for pid in result.pids)
