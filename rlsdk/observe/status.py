"""Plain data and text views of a live Session: rank liveness, the version panel, the last batch's staleness.

Pure functions over :meth:`Session.status` and ``session.metrics.history``; the notebook dashboard and the
terminal view (:meth:`Session.status_text`) both render from them, so they always show the same facts.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from rlsdk.procutil import pid_alive

# Metrics the dashboard plots, as (title, how to read one merged step). Step time is the wall time of the step's
# three timed calls (rollout, update, sync); the reward/loss/KL/clip fraction are the update's token means.
PLOTTED_METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean",)),
    ("loss", ("train/loss",)),
    ("KL", ("train/kl",)),
    ("clip fraction", ("train/clip_fraction",)),
    ("step time (s)", ("time/rollout_s", "time/update_s", "time/sync_s")),
    ("held-out pass@1 (greedy)", ("eval/pass@1",)),
)
# Plotted only once a step logged them: sampled evaluation and supervised fine-tuning (Session.sft_update).
OPTIONAL_PLOTTED_METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("held-out pass@1 (sampled)", ("eval_sampled/pass@1",)),
    ("SFT loss", ("sft/loss",)),
)


def in_jupyter() -> bool:
    """True inside a Jupyter kernel (where ipywidgets render); False in a script or a terminal IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def rank_alive(pid: int | None, heartbeat_age_s: float | None, heartbeat_timeout_s: float) -> bool:
    """A rank is alive when its process exists and its last heartbeat is younger than the heartbeat timeout."""
    return heartbeat_age_s is not None and heartbeat_age_s < heartbeat_timeout_s and pid_alive(pid)


def merged_history(history: Iterable[tuple[int, Mapping[str, float]]]) -> list[tuple[int, dict[str, float]]]:
    """One dict per step: ``update`` and ``sync_weights`` log separately under the same step number."""
    merged: dict[int, dict[str, float]] = {}
    for step, metrics in history:
        merged.setdefault(step, {}).update(metrics)
    return sorted(merged.items())


def series(history: list[tuple[int, dict[str, float]]], keys: tuple[str, ...]) -> list[tuple[int, float]]:
    """``(step, value)`` for the steps that have every key (summed when several), from :func:`merged_history`."""
    out = []
    for step, metrics in history:
        if all(key in metrics for key in keys):
            out.append((step, sum(metrics[key] for key in keys)))
    return out


def last_batch_staleness(
    history: Iterable[tuple[int, Mapping[str, float]]], max_staleness: int
) -> dict[str, Any] | None:
    """The staleness verdict of the last batch trained on, or ``None`` before the first update.

    Staleness = the trainer's version when it trained on the batch minus the batch's oldest behaviour version.
    Verdicts: ``on-policy`` (staleness 0), ``off-policy, within max_staleness`` or ``dropped N stale samples``.
    """
    last: Mapping[str, float] | None = None
    for _, metrics in history:
        if "version/behaviour_min" in metrics and "version/trainer" in metrics:
            last = metrics
    if last is None:
        return None
    trained_at = int(last["version/trainer"]) - 1  # the update published trained_at + 1
    behaviour_min = int(last["version/behaviour_min"])
    dropped = int(last.get("train/dropped_stale", 0.0))
    staleness = trained_at - behaviour_min
    if dropped:
        verdict = f"dropped {dropped} stale samples"
    elif staleness == 0:
        verdict = "on-policy"
    else:
        verdict = "off-policy, within max_staleness"
    return {
        "step": int(last.get("step", 0)),
        "trainer_version": trained_at,
        "behaviour_min": behaviour_min,
        "staleness": staleness,
        "max_staleness": max_staleness,
        "dropped": dropped,
        "verdict": verdict,
    }


def diverged_at(report: Any) -> str | None:
    """``diverged at group G seq S: KIND on rank(s) [...] (op at file:line, command C #N)`` for a trace report
    whose ranks desynced; ``None`` when they agree or one rank is merely slow (a straggler)."""
    div = getattr(report, "divergence", None)
    if div is None or div.kind == "straggler":
        return None
    return str(div.headline())


def format_command(info: Mapping[str, Any]) -> str:
    """A rank's current command with its reported progress: ``update (3/8)``, or ``idle``."""
    command = info.get("command")
    if not command:
        return "idle"
    progress = info.get("progress")
    return f"{command} ({progress[0]}/{progress[1]})" if progress else str(command)


def format_age(age_s: float | None) -> str:
    return "-" if age_s is None else f"{age_s:.1f}s"


def format_status_text(status: Mapping[str, Any], history: Iterable[tuple[int, Mapping[str, float]]] = ()) -> str:
    """The terminal view: ranks, versions, the last batch's staleness and the latest metrics, in a few lines."""
    lines = [
        f"session step {status.get('step', 0)}"
        + (" (closed)" if status.get("closed") else "")
        + f"  at {time.strftime('%H:%M:%S')}"
    ]
    sync = "in sync" if status.get("in_sync") else "OUT OF SYNC"
    lines.append(
        f"versions: trainer published v{status.get('trainer_version')}, engine serves v{status.get('engine_version')}"
        f" ({sync})"
    )
    batch = status.get("last_batch")
    if batch:
        lines.append(
            f"last batch: {batch['verdict']} (trained at v{batch['trainer_version']}, oldest sample "
            f"v{batch['behaviour_min']}, staleness {batch['staleness']} <= max {batch['max_staleness']})"
        )
    else:
        lines.append("last batch: none trained yet")
    for rank, info in sorted(status.get("ranks", {}).items()):
        state = "stopped" if status.get("closed") else "alive" if info.get("alive") else "DOWN"
        command = format_command(info)
        lines.append(
            f"rank {rank}: {state:<5} pid {info.get('pid')}  command {command:<16} "
            f"heartbeat {format_age(info.get('heartbeat_age_s'))} ago"
        )
    trace = status.get("trace")
    if trace:
        lines.append(f"trace at {time.strftime('%H:%M:%S', time.localtime(trace['time']))}: {trace['headline']}")
        if trace.get("diverged"):
            lines.append(f"DIVERGED: {trace['diverged']}")
    hung = status.get("hung")
    if hung:
        lines.append(
            f"HUNG: command {hung['command']} for {hung['seconds']:.0f} s ({hung['kind']}; report {hung['path']}): "
            "await session.keep_waiting() or session.close()"
        )
    merged = merged_history(history)
    if merged:
        step, metrics = merged[-1]
        parts = []
        for title, keys in (*PLOTTED_METRICS, *OPTIONAL_PLOTTED_METRICS):
            if all(key in metrics for key in keys):
                parts.append(f"{title} {sum(metrics[key] for key in keys):.4g}")
        lines.append(f"step {step}: " + ", ".join(parts))
    return "\n".join(lines)


def session_status(session: Any, *, failure: BaseException | None, ranks: dict[int, Any]) -> dict[str, Any]:
    """``Session.status()`` from the Session's public state, its run's ``failure`` and per-rank ``ranks``."""
    metrics = session.metrics
    return {
        "closed": session.closed,
        "failure": None if failure is None else str(failure).splitlines()[0],
        "ranks": ranks,
        "trainer_version": session.versions.trainer_version,
        "engine_version": session.versions.engine_version,
        "in_sync": session.versions.in_sync,
        "step": session.step,
        "trace": trace_summary(session.last_trace, session.last_trace_time),
        "hung": hung_summary(session.hung_command),
        "last_batch": last_batch_staleness(
            metrics.history if metrics is not None else (), session.config.rollout.max_staleness
        ),
    }


def trace_summary(report: Any, taken_at: float | None) -> dict[str, Any] | None:
    """``Session.status()['trace']``: a collective trace's time, verdict, headline and where the ranks diverged;
    None without one."""
    if report is None:
        return None
    return {"time": taken_at, "ok": report.ok, "headline": str(report).splitlines()[0], "diverged": diverged_at(report)}


def hung_summary(hung: Any) -> dict[str, Any] | None:
    """``Session.status()['hung']``: the command the hang watchdog reported hung (a ``HungCommand``), its age,
    the divergence kind and the saved report's path; None when nothing is hung."""
    if hung is None:
        return None
    return {
        "command": hung.command,
        "seconds": hung.seconds,
        "kind": getattr(hung.report.divergence, "kind", None),
        "path": None if hung.path is None else str(hung.path),
    }
