"""The watchdog's live checks without ranks: the trace mirror's incremental polls over real tracers, the two-poll
rule against hang_timeout_s, and the crash-safe tails' diagnosis added to a rank failure."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rlsdk.debug.analyze import analyze
from rlsdk.debug.live import LiveCheck, TraceMirror
from rlsdk.debug.rank import TRACE_POLL_QUERY
from rlsdk.debug.tracer import POLL_LIMIT, Tracer
from rlsdk.debug.watchdog import CollectiveHangError, WatchedControllerChannel


def issue(tracer: Tracer, shape: int = 4, *, sync: bool = True) -> list[Any]:
    def user_code() -> list[Any]:  # the record's call site: a frame outside rlsdk, as in training code
        return tracer.record("0", False, "allreduce", [torch.ones(shape)], "SUM", None, sync)

    return user_code()


class FakeChannel:
    """Answers ``trace_poll`` from in-process tracers, as the ranks' event threads would."""

    def __init__(self, tracers: dict[int, Tracer]) -> None:
        self.tracers = tracers
        self.bodies: list[Any] = []
        self.sent: list[int] = []

    async def query_events(self, name: str, timeout_s: float, body: Any = None) -> dict[int, Any]:
        assert name == TRACE_POLL_QUERY
        self.bodies.append(body)
        answers = {}
        for rank, tracer in self.tracers.items():
            answer = tracer.poll(body["since"].get(str(rank)), body["pending"].get(str(rank), []))
            self.sent.append(len(answer["records"]))
            answers[rank] = answer
        return answers


def test_trace_mirror_fetches_only_new_records_and_the_completion_of_pending_ones() -> None:
    tracers = {0: Tracer(), 1: Tracer()}
    for tracer in tracers.values():
        tracer.rank = list(tracers.values()).index(tracer)
        for _ in range(5):
            issue(tracer)[13] = 1.0  # completed
    waiting = issue(tracers[0])  # rank 0 now waits in seq 6
    channel = FakeChannel(tracers)
    mirror = TraceMirror(2)

    async def scenario() -> list[Any]:
        first = await mirror.poll(channel, 1.0)
        second = await mirror.poll(channel, 1.0)
        waiting[13] = 123.0  # it completes ...
        issue(tracers[1])[13] = 2.0  # ... and rank 1 issues seq 6
        third = await mirror.poll(channel, 1.0)
        return [first, second, third]

    first, second, third = asyncio.run(scenario())

    assert channel.sent == [6, 5, 0, 0, 0, 1]  # everything once, then nothing, then only what is new
    assert channel.bodies[2]["pending"] == {"0": [5]}  # it asks about the record it holds as pending
    assert [rec["seq"] for rec in first[0]["records"]] == [1, 2, 3, 4, 5, 6] and first[0]["records"][-1][
        "t_end"
    ] is None
    assert second[0]["records"][-1]["t_end"] is None
    assert third[0]["records"][-1]["t_end"] == 123.0 and [r["seq"] for r in third[1]["records"]][-1] == 6
    assert analyze(third).ok
    assert not third[0]["truncated"] and third[0]["heads"] == {"0": 6}


def test_trace_mirror_keeps_a_contiguous_window_when_more_than_one_poll_of_records_arrived() -> None:
    tracer = Tracer(capacity=4096)
    channel = FakeChannel({0: tracer})
    mirror = TraceMirror(1)
    issue(tracer)[13] = 1.0

    async def scenario() -> Any:
        await mirror.poll(channel, 1.0)
        for _ in range(POLL_LIMIT + 10):
            issue(tracer)[13] = 1.0
        return await mirror.poll(channel, 1.0)

    states = asyncio.run(scenario())

    seqs = [rec["seq"] for rec in states[0]["records"]]
    assert seqs == list(range(POLL_LIMIT + 11 - POLL_LIMIT + 1, POLL_LIMIT + 12))  # the newest, no gap
    assert states[0]["truncated"]


def test_trace_mirror_reads_the_crash_safe_tail_of_a_rank_whose_process_is_gone(tmp_path: Path) -> None:
    tracers = {rank: Tracer() for rank in (0, 1)}
    for rank, tracer in tracers.items():
        tracer.rank = rank
        tracer.open_tail(str(tmp_path / f"rank_{rank}.tail"))
        issue(tracer)[13] = 1.0
    channel = FakeChannel(tracers)
    mirror = TraceMirror(2)

    async def scenario() -> Any:
        await mirror.poll(channel, 1.0)
        issue(tracers[0], 4)  # rank 0 waits in seq 2 ...
        issue(tracers[1], 5)  # ... rank 1 issued a longer one: gloo aborted it before the next poll
        del channel.tracers[1]
        return await mirror.poll(channel, 1.0, gone=lambda rank: "process 7 is gone", tail_dir=tmp_path)

    states = asyncio.run(scenario())

    assert states[1]["crashed"] and states[1]["dead"] and [r["seq"] for r in states[1]["records"]] == [1, 2]
    div = analyze(states).divergence
    assert (div.kind, div.ranks, div.settled) == ("shape mismatch", [1], True)


def _states(kind: str) -> dict[int, dict[str, Any]]:
    def rec(seq: int, done: bool) -> dict[str, Any]:
        return {"group": "0", "seq": seq, "p2p": False, "op": "allreduce", "shapes": [[4]], "dtypes": ["float32"],
                "reduce_op": "SUM", "root": None, "command": "update", "command_seq": 3, "site": "probe.py:4",
                "stack": [], "t_start": time.monotonic() - 1, "t_end": None if not done else time.monotonic(),
                "peer_seq": None, "splits": None, "sync": True, "thread": 1, "index": seq}  # fmt: skip

    base = {"now": time.monotonic(), "groups": {"0": {"ranks": [0, 1]}}, "main_thread": 1, "threads": {"1": "M"}}
    lagging = {"command": None, "command_seq": None, "last_command_seq": 3}  # finished: a settled desync
    if kind == "straggler":
        lagging = {"command": "update", "command_seq": 3, "last_command_seq": 3}  # still computing
    return {
        0: base | {"rank": 0, "records": [rec(1, True), rec(2, False)], "command": "update", "command_seq": 3,
                   "last_command_seq": 3},
        1: base | {"rank": 1, "records": [rec(1, True)]} | lagging,
    }  # fmt: skip


def _cycle() -> dict[int, dict[str, Any]]:
    """Rank 0 waits in seq 2, which rank 1 lacks; rank 1 waits in a recv from rank 0, which rank 0 never sends."""
    states = _states("straggler")
    recv = dict(states[1]["records"][0], seq=1, p2p=True, op="recv", root=0, peer_seq=1, t_end=None, index=1)
    states[1]["records"] = [*states[1]["records"], recv]
    return states


def test_live_check_confirms_a_settled_cycle_on_the_second_poll_only_while_the_evidence_is_unchanged() -> None:
    states = _cycle()
    report = analyze(states)
    check = LiveCheck()

    first = check.observe(report, states)
    second = check.observe(report, states)
    moved = {0: states[0], 1: states[1] | {"count": 99}}
    third = check.observe(analyze(moved), moved)

    assert report.divergence.settled and report.divergence.evidence == [0, 1]
    assert not report.divergence.certain  # a two-rank wait-for cycle: either rank may be at fault, still a hang
    assert first is None and second is not None and second.kind == "p2p unmatched"
    assert third is None  # rank 1's state changed between the polls: start over


def test_live_check_never_confirms_a_straggler() -> None:
    states = _states("straggler")
    report = analyze(states)
    check = LiveCheck()

    assert report.divergence.kind == "straggler"
    assert [check.observe(report, states) for _ in range(5)] == [None] * 5


def _channel(tmp_path: Path, *, hang_timeout_s: float, poll_states: Any, full_states: Any) -> WatchedControllerChannel:
    channel = WatchedControllerChannel(
        b"secret",
        "session",
        hang_timeout_s=hang_timeout_s,
        hang_policy="raise",
        traces_dir=tmp_path / "traces",
        world_size=2,
        trace_poll_s=0.05,
    )

    async def poll(*_args: Any, **_kwargs: Any) -> Any:
        return poll_states()

    async def trace(*, timeout_s: float = 2.0) -> Any:
        channel.traces_taken = getattr(channel, "traces_taken", 0) + 1  # type: ignore[attr-defined]
        return analyze(full_states())

    channel._mirror.poll = poll  # type: ignore[method-assign]  # the ranks' answers, without ranks
    channel.trace = trace  # type: ignore[method-assign]
    return channel


def test_settled_divergence_is_raised_after_two_polls_long_before_hang_timeout(tmp_path: Path) -> None:
    channel = _channel(tmp_path, hang_timeout_s=30.0, poll_states=lambda: _states("desync"),
                       full_states=lambda: _states("desync"))  # fmt: skip

    async def scenario() -> tuple[CollectiveHangError, float]:
        task: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        start = time.monotonic()
        with pytest.raises(CollectiveHangError) as caught:
            await channel._watch("update", task, start)
        seconds = time.monotonic() - start
        task.cancel()
        return caught.value, seconds

    error, seconds = asyncio.run(scenario())

    assert seconds < 5.0
    assert error.report.divergence.kind == "missing collective" and error.report.divergence.settled
    assert channel.poll_stats["polls"] == 2 and channel.poll_stats["confirmed"] == 1
    assert error.path is not None and (error.path / "report.txt").is_file()


def test_straggler_is_left_to_hang_timeout_and_never_raised(tmp_path: Path) -> None:
    channel = _channel(tmp_path, hang_timeout_s=0.3, poll_states=lambda: _states("straggler"),
                       full_states=lambda: _states("straggler"))  # fmt: skip

    async def scenario() -> list[Any]:
        task: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.8, task.set_result, ["done", "done"])
        return await channel._watch("update", task, time.monotonic())

    assert asyncio.run(scenario()) == ["done", "done"]
    assert channel.poll_stats["polls"] >= 5 and channel.poll_stats["settled"] == 0
    assert channel.traces_taken >= 1  # type: ignore[attr-defined]  # the hang check ran, and only logged


def test_live_divergence_is_not_raised_when_the_full_trace_disagrees(tmp_path: Path) -> None:
    channel = _channel(tmp_path, hang_timeout_s=30.0, poll_states=lambda: _states("desync"),
                       full_states=lambda: _states("straggler"))  # fmt: skip

    async def scenario() -> list[Any]:
        task: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.5, task.set_result, ["ok", "ok"])
        return await channel._watch("update", task, time.monotonic())

    assert asyncio.run(scenario()) == ["ok", "ok"]
    assert channel.poll_stats["confirmed"] == 0 and channel.poll_stats["settled"] >= 2


def test_ranks_dying_during_a_command_get_their_tails_diagnosis_added_to_the_error(tmp_path: Path) -> None:
    live = tmp_path / "traces" / "live"
    live.mkdir(parents=True)
    for rank, shape in ((0, 4), (1, 5)):  # rank 1 reduced a longer tensor: gloo aborted it
        tracer = Tracer()
        tracer.rank = rank
        tracer.open_tail(str(live / f"rank_{rank}.tail"))
        issue(tracer)
        issue(tracer, shape)
    channel = WatchedControllerChannel(
        b"secret", "session", hang_timeout_s=30.0, hang_policy="raise", traces_dir=tmp_path / "traces", world_size=2
    )
    channel._inflight = "update"
    error = RuntimeError("train rank 1 (pid 7) killed by signal SIGABRT")

    channel.fail_pending(error)

    notes = "\n".join(getattr(error, "__notes__", []))
    assert "shape mismatch" in notes and "group 0 seq 2" in notes
    assert error.trace_report.divergence.kind == "shape mismatch"  # type: ignore[attr-defined]
