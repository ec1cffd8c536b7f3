"""The tracer's records read from torch's Flight Recorder (the CUDA path), checked on CPU with gloo's buffer."""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest

from rlsdk.debug.analyze import analyze
from rlsdk.debug.flight_recorder import load_dump, records_from_dump
from rlsdk.debug.tracer import FIELDS
from rlsdk.testing.distributed import run_in_process_group


def _entry(record_id: int, seq: int, name: str, shape: list[int], **extra: Any) -> dict[str, Any]:
    """One entry as torch's NCCL Flight Recorder writes it (version 2.10 fields)."""
    entry = {
        "record_id": record_id,
        "pg_id": 0,
        "process_group": ("0", "default_pg"),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": record_id + 1,
        "profiling_name": name,
        "time_created_ns": 1_700_000_000_000_000_000 + record_id * 1_000_000,
        "input_sizes": [shape],
        "input_dtypes": ["BFloat16"],
        "output_sizes": [shape],
        "output_dtypes": ["BFloat16"],
        "state": "completed",
        "time_discovered_completed_ns": 1_700_000_000_000_000_000 + record_id * 1_000_000 + 500,
        "retired": True,
        "is_p2p": False,
        "thread_id": "140000",
        "frames": [
            {"name": "all_reduce", "filename": "/site-packages/torch/distributed/distributed_c10d.py", "line": 3245},
            {"name": "step", "filename": "/home/me/train.py", "line": 42},
            {"name": "main", "filename": "/home/me/train.py", "line": 7},
        ],
    }
    entry.update(extra)
    return entry


def _state(rank: int, entries: list[dict[str, Any]], **state: Any) -> dict[str, Any]:
    rows = records_from_dump(
        {"entries": entries},
        wall_minus_monotonic=1_699_999_000.0,
        now=2_000.0,
        history=[(900.0, "update", 5)],
        prefixes=("/site-packages/torch/",),
    )
    return {"rank": rank, "records": [dict(zip(FIELDS, row, strict=True)) for row in rows], **state}


def test_records_from_an_nccl_dump_keep_group_seq_op_shapes_site_command_and_completion() -> None:
    pending = _entry(1, 2, "nccl:_reduce_scatter_base", [8, 4], state="scheduled", retired=False)
    pending["time_discovered_completed_ns"] = None

    state = _state(0, [_entry(0, 1, "nccl:all_reduce", [4]), pending])

    first, second = state["records"]
    assert (first["group"], first["seq"], first["op"], first["shapes"], first["dtypes"]) == (
        "0", 1, "allreduce", ((4,),), ("bfloat16",)
    )  # fmt: skip
    assert first["site"] == "/home/me/train.py:42"  # torch's own frame skipped
    assert first["stack"] == ["/home/me/train.py:42 in step", "/home/me/train.py:7 in main"]
    assert (first["command"], first["command_seq"]) == ("update", 5)  # started at 1000.0 s, after the command
    assert first["t_start"] == pytest.approx(1000.0, abs=1e-6)
    assert first["t_end"] == pytest.approx(1000.0000005, abs=1e-6)
    assert (second["op"], second["t_end"], second["sync"], second["index"]) == ("_reduce_scatter_base", None, False, 1)


def test_records_from_a_dump_pair_p2p_calls_by_peer_and_count() -> None:
    send = _entry(0, 0, "nccl:send 0->1", [4], is_p2p=True, p2p_seq_id=1)
    recv = _entry(0, 0, "nccl:recv 1<-0", [4], is_p2p=True, p2p_seq_id=1)

    (sent,) = _state(0, [send])["records"]
    (received,) = _state(1, [recv])["records"]

    assert (sent["op"], sent["root"], sent["peer_seq"], sent["p2p"]) == ("send", 1, 1, True)
    assert (received["op"], received["root"], received["peer_seq"]) == ("recv", 0, 1)


def test_analyze_on_flight_recorder_records_names_the_op_mismatch_rank_seq_and_call_site() -> None:
    # rank 0 all-reduces where rank 1 broadcasts, both at collective 2 (the desync the GPU test provokes)
    rank0 = [_entry(0, 1, "nccl:all_reduce", [4]), _entry(1, 2, "nccl:all_reduce", [4], state="scheduled")]
    rank1 = [_entry(0, 1, "nccl:all_reduce", [4]), _entry(1, 2, "nccl:broadcast", [4], state="scheduled")]
    for entry in (rank0[1], rank1[1]):
        entry.update(retired=False, time_discovered_completed_ns=None)

    report = analyze({0: _state(0, rank0), 1: _state(1, rank1)}, site_check=lambda site: False)

    div = report.divergence
    assert div is not None and div.kind == "op mismatch" and div.seq == 2 and div.settled
    assert not div.certain  # two ranks disagree with no third to side with either: a tie
    sites = {side["rank"]: side["record"]["site"] for side in div.sides}
    assert sites == {0: "/home/me/train.py:42", 1: "/home/me/train.py:42"}


def test_load_dump_refuses_a_pickle_that_names_a_class() -> None:
    class Evil:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="only plain data"):
        load_dump(pickle.dumps({"entries": [Evil()]}))
    with pytest.raises(ValueError, match="expected a dict"):
        load_dump(pickle.dumps([1, 2]))


def _gloo_missing_collective(rank: int, world_size: int) -> dict[str, Any]:
    """Two collectives on both ranks, then a third only rank 0 has posted when both read their buffers; rank 1
    posts it afterwards so the ranks finish cleanly."""
    import time

    import torch
    import torch.distributed as dist

    from rlsdk.debug.flight_recorder import FlightRecorderView
    from rlsdk.debug.tracer import set_command

    set_command("update", 3)
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    dist.broadcast(tensor, src=0)
    work = dist.all_reduce(tensor, async_op=True) if rank == 0 else None
    view = FlightRecorderView("cpu")
    expected_done = 2  # the two collectives both ranks posted; torch retires them shortly after they complete
    deadline = time.monotonic() + 10.0
    state = view.snapshot()
    while sum(rec["t_end"] is not None for rec in state["records"]) < expected_done and time.monotonic() < deadline:
        time.sleep(0.05)
        state = view.snapshot()
    polled = view.poll(since=1, pending=[0])
    # both buffers read (through the store: a gloo barrier would queue behind rank 0's pending all-reduce)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"read{rank}", "1")
    store.wait([f"read{peer}" for peer in range(world_size)])
    if rank == 1:
        dist.all_reduce(tensor)
    else:
        assert work is not None
        work.wait()
    return {"state": state, "polled": polled}


@pytest.mark.distributed
def test_flight_recorder_view_on_gloo_ranks_feeds_the_analyser_a_missing_collective(monkeypatch) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")  # the spawned ranks inherit it

    results = run_in_process_group(_gloo_missing_collective, 2)

    states = {rank: result["state"] for rank, result in enumerate(results)}
    ops = {rank: [(rec["seq"], rec["op"]) for rec in state["records"]] for rank, state in states.items()}
    assert ops[0] == [(1, "allreduce"), (2, "broadcast"), (3, "allreduce")]
    assert ops[1] == [(1, "allreduce"), (2, "broadcast")]
    assert all(rec["command"] == "update" and rec["command_seq"] == 3 for rec in states[0]["records"])
    assert states[0]["records"][0]["site"].endswith("test_flight_recorder.py:" + str(_line("dist.all_reduce(tensor)")))
    assert states[0]["records"][2]["t_end"] is None and states[1]["records"][1]["t_end"] is not None
    assert states[0]["heads"] == {"0": 3} and states[1]["heads"] == {"0": 2}
    polled = results[0]["polled"]
    assert [row[FIELDS.index("seq")] for row in polled["records"]] == [2, 3]  # index >= 1, as lists
    assert polled["done"] and polled["done"][0][0] == 0  # record 0 completed

    report = analyze(states, site_check=lambda site: False)

    div = report.divergence
    assert div is not None and div.seq == 3 and div.kind in ("missing collective", "straggler")
    assert {side["rank"] for side in div.sides} == {0, 1}


def _line(text: str) -> int:
    """The line of this file's first line containing ``text`` inside :func:`_gloo_missing_collective`."""
    lines = open(__file__).read().splitlines()  # noqa: SIM115 - one short read
    start = next(i for i, line in enumerate(lines) if line.startswith("def _gloo_missing_collective"))
    return next(i for i, line in enumerate(lines[start:], start) if text in line) + 1


def test_view_polls_without_stacks_and_dumps_frames_once_a_call_stays_pending_unplaced(monkeypatch) -> None:
    from rlsdk.debug import flight_recorder
    from rlsdk.debug.live import TraceMirror

    done = _entry(0, 1, "nccl:all_reduce", [4])
    stuck = _entry(1, 2, "nccl:all_reduce", [4], state="scheduled", retired=False, time_discovered_completed_ns=None)
    dumps: list[bool] = []

    def fake_dump(device: str, *, stacks: bool = True) -> bytes:
        dumps.append(stacks)
        entries = [dict(e) if stacks else {k: v for k, v in e.items() if k != "frames"} for e in (done, stuck)]
        return pickle.dumps({"entries": entries})

    monkeypatch.setattr(flight_recorder, "dump_bytes", fake_dump)
    view = flight_recorder.FlightRecorderView("cuda")
    view._prefixes = ("/site-packages/torch/",)  # the fake frames' torch
    mirror = TraceMirror(1)

    first = view.poll()
    mirror._merge(0, first)
    second = view.poll(since=2, pending=[1])
    state = mirror._merge(0, second)
    third = view.poll(since=2, pending=[1])

    site = FIELDS.index("site")
    assert [row[site] for row in first["records"]] == ["?", "?"]  # no frames: the cheap dump
    assert dumps == [False, False, True, False]  # frames once, when the unplaced call was still pending
    assert second["sites"] == [[1, "/home/me/train.py:42"]] and third["sites"] == second["sites"]
    assert state["records"][1]["site"] == "/home/me/train.py:42"  # the controller's copy placed too
