"""A real Session (the default launch config: hang_timeout_s 30 s, live checks every 1 s) in the embedded,
colocated and FSDP2 setups: every settled divergence a custom rank command makes is raised at most 5 s after the
diverging call; a rank blocked on a Python lock is a straggler, never raised. Slow: one Session start per case."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import _faults
import pytest

from rlsdk import Session, SessionConfig
from rlsdk.debug.watchdog import CollectiveHangError
from rlsdk.launch.supervised import RankProcessError

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LIMIT_S = 5.0
SETUPS = {
    "embedded": lambda c: c,
    "colocated": lambda c: dataclasses.replace(c, inference=dataclasses.replace(c.inference, engine="colocated")),
    "fsdp2": lambda c: dataclasses.replace(c, train=dataclasses.replace(c.train, parallelism="fsdp2")),
}
# (probe, kind, faulty ranks, how it ends: "hang" = the ranks stay stuck, "crash" = gloo aborts a rank (the live
# check reads its crash-safe tail; if the launcher reports the death first, the error carries the same diagnosis),
# "completes" = gloo returns a wrong result and the command goes on), and whether the verdict is certain: with two
# ranks only a rank-conditional call site (the broadcast under `if rank == 0`) names the rank at fault from
# evidence; the others are ties, raised as fast, with both ranks among the candidates)
CASES = [
    ("session_rank0_broadcast", "extra collective", [0], "hang", True),
    ("session_missing", "missing collective", [1], "hang", False),
    ("session_op_mismatch", "op mismatch", [1], "hang", False),
    ("session_source_mismatch", "source mismatch", [1], "hang", False),
    ("session_p2p_unmatched", "p2p unmatched", [1], "hang", False),
    ("session_p2p_cycle", "p2p unmatched", [1], "hang", False),
    ("session_reduce_op_mismatch", "reduce-op mismatch", [1], "completes", False),
    ("session_shape_mismatch", "shape mismatch", [1], "crash", False),
]


def _diverging_call_start(div: Any) -> float:
    """When the diverging call was issued (rank and test share the machine's monotonic clock): the latest
    ``t_start`` among the sides' calls at the divergence."""
    starts = [
        float(side["record"]["t_start"])
        for side in div.sides
        if side.get("record") and (side["record"]["group"], side["record"]["seq"]) == (div.group, div.seq)
    ]
    return max(starts or [float(side["record"]["t_start"]) for side in div.sides if side.get("record")])


async def _run_case(session: Session, probe: str, ending: str) -> dict[str, Any]:
    try:
        await session.call("call_function", {"target": f"_faults:{probe}"})
    except CollectiveHangError as error:
        caught_at = time.monotonic()
        report = error.report
        status = session.status()
        results = await session.keep_waiting(timeout_s=30.0) if ending == "completes" else None
        return {"report": report, "after_s": caught_at - _diverging_call_start(report.divergence),
                "diverged": status["trace"]["diverged"], "results": results, "error": "hang"}  # fmt: skip
    except RankProcessError as error:
        caught_at = time.monotonic()
        report = getattr(error, "trace_report", None)
        assert report is not None, f"no tail diagnosis on {error}"
        return {"report": report, "after_s": caught_at - _diverging_call_start(report.divergence),
                "diverged": session.status()["trace"]["diverged"], "error": "crash"}  # fmt: skip
    raise AssertionError(f"{probe}: the command completed without a report")


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_each_settled_divergence_is_raised_within_5s_of_the_diverging_call(
    setup: str, small_config: SessionConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(Path(_faults.__file__).parent), os.environ.get("PYTHONPATH")]))
    )
    config = SETUPS[setup](small_config)

    async def scenario() -> dict[str, dict[str, Any]]:
        outcomes = {}
        session = await Session.start(config)
        try:
            for probe, _kind, _ranks, ending, _certain in CASES:
                outcomes[probe] = await _run_case(session, probe, ending)
                if ending != "completes":
                    await session.restart(resume_from=None)  # the ranks are stuck or dead: a user restarts
                else:
                    await session.call("noop")  # the session goes on
        finally:
            await session.close()
        return outcomes

    outcomes = asyncio.run(scenario())

    for probe, kind, ranks, ending, certain in CASES:
        outcome = outcomes[probe]
        print(f"{setup} {probe}: {ending}, raised {outcome['after_s']:.2f} s after the diverging call")  # for -rP
        div = outcome["report"].divergence
        assert (div.kind, div.ranks, div.settled, div.certain) == (kind, ranks, True, certain), (
            setup,
            probe,
            str(outcome["report"]),
        )
        assert outcome["after_s"] <= LIMIT_S, (setup, probe, outcome["after_s"])
        assert outcome["diverged"].startswith("diverged at"), (setup, probe)
        assert outcome["error"] == "hang" or ending == "crash", (setup, probe, outcome["error"])
    assert len(outcomes["session_reduce_op_mismatch"]["results"]) == 2  # keep_waiting() got the late results


def test_rank_blocked_on_a_python_lock_is_a_straggler_with_its_stack_never_raised(
    small_config: SessionConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(Path(_faults.__file__).parent), os.environ.get("PYTHONPATH")]))
    )
    config = dataclasses.replace(small_config, launch=dataclasses.replace(small_config.launch, hang_timeout_s=3.0))

    async def scenario() -> tuple[list[Any], Any, dict[str, int]]:
        async with await Session.start(config) as session:
            results = await session.call("call_function", {"target": "_faults:session_lock_straggler"})
            return results, session.last_trace, dict(session._run.channel.poll_stats)

    results, trace, polls = asyncio.run(scenario())

    assert results == [{"rank": 0}, {"rank": 1}]  # the command completed: nothing was raised
    div = trace.divergence  # the hang check's report at 3 s
    assert div is not None and (div.kind, div.ranks, div.certain) == ("straggler", [1], False), str(trace)
    assert "SESSION_LOCK_SITE" in str(trace)  # rank 1's main thread, blocked on the lock
    assert polls["polls"] >= 3 and polls["settled"] == 0 and polls["confirmed"] == 0
