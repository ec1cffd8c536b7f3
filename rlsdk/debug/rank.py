"""Rank side of the tracer: the queries the controller sends to a rank's event thread.

``trace``: the full tracer snapshot and every thread's stack (for reports). ``trace_poll``: the cheap view the
live check asks for about once a second while a command runs (:meth:`rlsdk.debug.tracer.Tracer.poll`: only the
records the controller does not hold yet, no stacks).
"""

from __future__ import annotations

from typing import Any

from rlsdk.debug.tracer import get_tracer, snapshot, thread_stacks

__all__ = [
    "TRACE_POLL_QUERY",
    "TRACE_QUERY",
    "flight_recorder_poll_state",
    "flight_recorder_trace_state",
    "install_trace_query",
    "poll_state",
    "trace_state",
]

TRACE_QUERY = "trace"
"""Name of the control-channel query answered with :func:`trace_state`."""

TRACE_POLL_QUERY = "trace_poll"
"""Name of the control-channel query answered with :func:`poll_state`."""


def trace_state(body: Any = None) -> dict[str, Any]:
    """The tracer snapshot plus the Python stacks of every thread (``sys._current_frames``)."""
    state = snapshot()
    state["stacks"] = thread_stacks()
    return state


def poll_state(body: Any = None) -> dict[str, Any]:
    """:meth:`~rlsdk.debug.tracer.Tracer.poll` for this rank, with ``body = {"since": {"RANK": int, ...},
    "pending": {"RANK": [int, ...], ...}}`` (one body serves every rank; a missing entry: from the start, none).

    Raises:
        ValueError: a malformed body.
    """
    tracer = get_tracer()
    since, pending = _poll_body(body, str(tracer.rank))
    return tracer.poll(since, pending)


def _poll_body(body: Any, key: str) -> tuple[int | None, list[int]]:
    """This rank's ``since`` and ``pending`` from a ``trace_poll`` body (see :func:`poll_state`)."""
    body = body if body is not None else {}
    if not isinstance(body, dict) or not isinstance(body.get("since", {}), dict):
        raise ValueError("trace_poll body must be {'since': {rank: int}, 'pending': {rank: [int]}}")
    since = body.get("since", {}).get(key)
    pending = (body.get("pending") or {}).get(key) or []
    if since is not None and (type(since) is not int or since < 0):
        raise ValueError(f"trace_poll since={since!r} is invalid: allowed None or an int >= 0")
    if not isinstance(pending, list) or not all(type(index) is int for index in pending):
        raise ValueError("trace_poll pending must be a list of record indices (ints)")
    return since, pending


def flight_recorder_poll_state(body: Any = None) -> dict[str, Any]:
    """:func:`poll_state` answered from torch's Flight Recorder (:mod:`rlsdk.debug.flight_recorder`)."""
    from rlsdk.debug import flight_recorder

    since, pending = _poll_body(body, str(get_tracer().rank))
    return flight_recorder.poll(since, pending)


def flight_recorder_trace_state(body: Any = None) -> dict[str, Any]:
    """:func:`trace_state` answered from torch's Flight Recorder (:mod:`rlsdk.debug.flight_recorder`)."""
    from rlsdk.debug import flight_recorder

    return flight_recorder.snapshot()


def install_trace_query(channel: Any, *, flight_recorder: bool = False) -> None:
    """Answer ``trace`` and ``trace_poll`` queries on ``channel`` (a ``RankChannel``) from its event thread: from
    the ``traced`` backend's records, or with ``flight_recorder`` (CUDA ranks on NCCL, with the tracer on) from
    torch's Flight Recorder buffer, in the same shape."""
    if flight_recorder:
        channel.set_query_handler(TRACE_QUERY, flight_recorder_trace_state)
        channel.set_query_handler(TRACE_POLL_QUERY, flight_recorder_poll_state)
        return
    channel.set_query_handler(TRACE_QUERY, trace_state)
    channel.set_query_handler(TRACE_POLL_QUERY, poll_state)
