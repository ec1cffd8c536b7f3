"""Rank side of the tracer: the ``trace`` query the controller sends to a rank's event thread."""

from __future__ import annotations

from typing import Any

from rlsdk.debug.tracer import snapshot, thread_stacks

__all__ = ["TRACE_QUERY", "install_trace_query", "trace_state"]

TRACE_QUERY = "trace"
"""Name of the control-channel query answered with :func:`trace_state`."""


def trace_state(body: Any = None) -> dict[str, Any]:
    """The tracer snapshot plus the Python stacks of every thread (``sys._current_frames``)."""
    state = snapshot()
    state["stacks"] = thread_stacks()
    return state


def install_trace_query(channel: Any) -> None:
    """Answer ``trace`` queries on ``channel`` (a ``RankChannel``) from its event thread."""
    channel.set_query_handler(TRACE_QUERY, trace_state)
