"""The live Session dashboard: ranks, versions, metric plots and rank-tagged logs, updating while cells await.

``session.dashboard()`` returns a :class:`Dashboard` (ipywidgets) inside Jupyter and a :class:`TextDashboard`
(periodic plain-text status through the project logger) elsewhere. Both refresh from a periodic asyncio task on
the running event loop, so a cell awaiting ``session.update(...)`` keeps the view live, and neither ever blocks
the loop:

- log records reach a bounded, thread-safe buffer (:class:`LogBuffer`, an O(1) append per record) through the
  log router's listener; the widgets are re-rendered at most once per ``interval_s`` and only when something
  changed, showing at most ``max_lines`` filtered lines, however fast the ranks log;
- metric plots are small SVG line charts rendered here (no plotting dependency);
- rank status and the version panel come from :meth:`Session.status` (see :mod:`rlsdk.observe.status`);
- the tracer view shows the session's latest collective trace (``session.last_trace``: every check of the hang
  watchdog, every divergence its live checks confirm, and every ``await session.trace()``) as a table per rank
  (last group:seq, op, call site, age) with the diverging ranks highlighted, under a red "diverged at ..." line
  (also in the title) as soon as a desync is known; "trace now" takes one; while the watchdog reports a command
  hung it offers "keep waiting" (``session.keep_waiting()``) and "terminate ranks" (``session.close()``).

nbclient (and so an executed notebook saved to disk) only records widget updates sent while a cell runs; call
:meth:`Dashboard.refresh` in a later cell to capture the current state.
"""

from __future__ import annotations

import asyncio
import html
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from rlsdk.observe.logging import get_logger
from rlsdk.observe.status import (
    OPTIONAL_PLOTTED_METRICS,
    PLOTTED_METRICS,
    format_age,
    format_command,
    format_status_text,
    in_jupyter,
    merged_history,
    series,
)

logger = get_logger("rlsdk.observe.dashboard")

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ALL = "all"
_LEVEL_COLOURS = {"DEBUG": "#888", "INFO": "inherit", "WARNING": "#b36b00", "ERROR": "#c00", "CRITICAL": "#c00"}


class LogBuffer:
    """A bounded, thread-safe buffer of log record dicts (the router calls it from any thread).

    Appending is O(1) and never blocks on rendering; the oldest records fall off past ``maxlen``. ``total`` counts
    every record ever received, so a reader can tell whether anything arrived since it last looked.
    """

    def __init__(self, maxlen: int = 5000) -> None:
        if maxlen < 1:
            raise ValueError(f"LogBuffer maxlen must be >= 1, got {maxlen}")
        self._records: deque[dict[str, Any]] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self.total = 0
        self.closed = False

    def __call__(self, record: dict[str, Any]) -> None:
        if self.closed:
            return
        with self._lock:
            self._records.append(record)
            self.total += 1

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._records)


def record_source(record: dict[str, Any]) -> str:
    """``rank N`` for a train rank, else the record's role (``controller``, ``launcher``, ``inference``)."""
    rank = record.get("rank")
    return f"rank {rank}" if rank is not None else str(record.get("role") or "controller")


def filter_records(
    records: Iterable[dict[str, Any]], *, source: str = ALL, min_level: str = "DEBUG", component: str = ALL
) -> list[dict[str, Any]]:
    """Records from ``source`` (see :func:`record_source`; ``all``), at ``min_level`` or above, of ``component``."""
    floor = logging.getLevelName(min_level) if min_level in LEVELS else logging.DEBUG
    return [
        r
        for r in records
        if r.get("levelno", logging.INFO) >= floor
        and (source == ALL or record_source(r) == source)
        and (component == ALL or r.get("component") == component)
    ]


def render_logs_html(records: Sequence[dict[str, Any]], max_lines: int) -> str:
    from rlsdk.observe.logging import format_record_dict

    shown = records[-max_lines:]
    lines = []
    for record in shown:
        colour = _LEVEL_COLOURS.get(str(record.get("level")), "inherit")
        lines.append(f'<span style="color:{colour}">{html.escape(format_record_dict(record))}</span>')
    if not lines:
        lines.append('<span style="color:#888">no log records match the filters yet</span>')
    hidden = len(records) - len(shown)
    more = f'<div style="color:#888">{hidden} older matching records not shown</div>' if hidden > 0 else ""
    return (
        f'{more}<pre class="rlsdk-logs" style="max-height:260px;overflow-y:auto;font-size:11px;margin:0">'
        + "\n".join(lines)
        + "</pre>"
    )


def render_ranks_html(status: dict[str, Any]) -> str:
    rows = []
    for rank, info in sorted(status.get("ranks", {}).items()):
        if status.get("closed"):
            state = '<span style="color:#888">stopped</span>'  # closed on purpose, not a failure
        elif info.get("alive"):
            state = '<b style="color:#080">alive</b>'
        else:
            state = '<b style="color:#c00">DOWN</b>'
        rows.append(
            f"<tr><td>rank {rank}</td><td>{state}</td><td>{html.escape(format_command(info))}</td>"
            f"<td>{format_age(info.get('heartbeat_age_s'))}</td><td>{info.get('pid')}</td></tr>"
        )
    if not rows:
        rows.append('<tr><td colspan="5">no ranks registered</td></tr>')
    return (
        '<table class="rlsdk-ranks" style="font-size:12px"><tr><th>rank</th><th>state</th><th>command</th>'
        "<th>heartbeat</th><th>pid</th></tr>" + "".join(rows) + "</table>"
    )


def render_versions_html(status: dict[str, Any]) -> str:
    in_sync = status.get("in_sync")
    sync = '<b style="color:#080">in sync</b>' if in_sync else '<b style="color:#b36b00">out of sync</b>'
    batch = status.get("last_batch")
    if batch:
        colour = "#080" if batch["verdict"] == "on-policy" else "#b36b00"
        verdict = (
            f'<b style="color:{colour}">{html.escape(batch["verdict"])}</b> (trained at v{batch["trainer_version"]}, '
            f"oldest sample v{batch['behaviour_min']}, staleness {batch['staleness']} &le; "
            f"max {batch['max_staleness']})"
        )
    else:
        verdict = "no batch trained yet"
    return (
        '<table class="rlsdk-versions" style="font-size:12px">'
        f"<tr><td>trainer published</td><td><b>v{status.get('trainer_version')}</b></td></tr>"
        f"<tr><td>engine served</td><td><b>v{status.get('engine_version')}</b> ({sync})</td></tr>"
        f"<tr><td>last batch</td><td>{verdict}</td></tr>"
        f"<tr><td>step</td><td>{status.get('step')}</td></tr></table>"
    )


def render_diverged_html(diverged: str | None) -> str:
    """The red "diverged at ..." line (empty when the ranks agree)."""
    if not diverged:
        return ""
    return f'<div class="rlsdk-diverged" style="color:#c00"><b>{html.escape(diverged)}</b></div>'


def render_tracer_html(
    report: Any, taken_at: float | None, hung: dict[str, Any] | None, diverged: str | None = None
) -> str:
    """The tracer view: the divergence (if any), when the latest trace was taken, the hang (if any) and the
    report's per-rank table."""
    parts = [render_diverged_html(diverged)]
    if hung:
        parts.append(
            f'<div style="color:#c00"><b>HUNG</b>: command {html.escape(str(hung["command"]))} for '
            f"{hung['seconds']:.0f} s ({html.escape(str(hung['kind']))}); report saved under "
            f"{html.escape(str(hung['path']))}</div>"
        )
    if report is None:
        parts.append(
            '<span style="color:#888">no collective trace yet: the watchdog checks running commands live and '
            "traces every command that outlasts launch.hang_timeout_s; click <i>trace now</i> to take one</span>"
        )
    else:
        when = time.strftime("%H:%M:%S", time.localtime(taken_at)) if taken_at is not None else "?"
        parts.append(f'<div style="font-size:11px;color:#888">traced at {when}</div>')
        table = getattr(report, "_repr_html_", None)
        parts.append(table() if table is not None else f"<pre>{html.escape(str(report))}</pre>")
    return '<div class="rlsdk-tracer" style="font-size:12px">' + "".join(parts) + "</div>"


def svg_line_chart(points: Sequence[tuple[int, float]], title: str, *, width: int = 210, height: int = 90) -> str:
    """A small SVG line chart of ``(step, value)`` points with the last value, min and max written on it."""
    pad_x, pad_top, pad_bottom = 4, 16, 12
    head = f'<text x="{pad_x}" y="11" font-size="11" font-weight="bold">{html.escape(title)}</text>'
    if not points:
        body = f'<text x="{pad_x}" y="{height // 2 + 6}" font-size="10" fill="#888">no data yet</text>'
        return f'<svg width="{width}" height="{height}" class="rlsdk-plot">{head}{body}</svg>'
    stride = max(1, len(points) // 300)  # bounded SVG size on long runs
    shown = list(points[::stride])
    if shown[-1] != points[-1]:
        shown.append(points[-1])
    steps = [p[0] for p in shown]
    values = [p[1] for p in shown]
    lo, hi = min(values), max(values)
    span_y = (hi - lo) or 1.0
    first, last = steps[0], steps[-1]
    span_x = (last - first) or 1
    plot_h = height - pad_top - pad_bottom
    xy = [
        (pad_x + (s - first) / span_x * (width - 2 * pad_x), pad_top + (hi - v) / span_y * plot_h)
        for s, v in zip(steps, values)
    ]
    coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
    marker = f'<circle cx="{xy[-1][0]:.1f}" cy="{xy[-1][1]:.1f}" r="2" fill="#1f77b4"/>'
    label = (
        f'<text x="{width - pad_x}" y="11" font-size="10" text-anchor="end">{values[-1]:.4g} '
        f"@ {steps[-1]}</text>"
        f'<text x="{pad_x}" y="{height - 2}" font-size="9" fill="#888">min {lo:.3g} max {hi:.3g}</text>'
    )
    line = f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{coords}"/>'
    return f'<svg width="{width}" height="{height}" class="rlsdk-plot">{head}{label}{line}{marker}</svg>'


def render_metrics_html(history: Iterable[tuple[int, dict[str, float]]]) -> str:
    merged = merged_history(history)
    charts = [svg_line_chart(series(merged, keys), title) for title, keys in PLOTTED_METRICS]
    for title, keys in OPTIONAL_PLOTTED_METRICS:
        points = series(merged, keys)
        if points:
            charts.append(svg_line_chart(points, title))
    return '<div class="rlsdk-metrics" style="display:flex;flex-wrap:wrap;gap:6px">' + "".join(charts) + "</div>"


def render_samples_html(texts: dict[str, tuple[int, str]]) -> str:
    """The latest sample completions (``MetricsWriter.texts``: the Markdown tables ``Session.update`` and
    ``Session.evaluate`` log under ``samples`` and ``eval/samples``) as HTML tables."""
    parts = []
    for tag in ("samples", "eval/samples"):
        if tag not in texts:
            continue
        step, text = texts[tag]
        rows = [line.strip().strip("|").split(" | ") for line in text.splitlines() if line.startswith("|")]
        rows = [row for row in rows if not all(cell.strip() == "---" for cell in row)]
        if not rows:
            continue
        head, body = rows[0], rows[1:]

        def cells(row: list[str], tag_name: str) -> str:
            return "".join(
                f"<{tag_name}>{html.escape(cell.strip().replace(chr(92) + '|', '|'))}</{tag_name}>" for cell in row
            )

        table = f"<tr>{cells(head, 'th')}</tr>" + "".join(f"<tr>{cells(row, 'td')}</tr>" for row in body)
        parts.append(f"<div><b>{html.escape(tag)}</b> (step {step})<table>{table}</table></div>")
    return '<div class="rlsdk-samples" style="display:flex;gap:24px">' + "".join(parts) + "</div>"


class _Refresher:
    """Shared by both views: the log listener and the periodic refresh task on the running loop."""

    def __init__(self, session: Any, *, interval_s: float, max_records: int) -> None:
        if interval_s <= 0:
            raise ValueError(f"dashboard interval_s must be > 0, got {interval_s}")
        self.session = session
        self.interval_s = interval_s
        self.logs = LogBuffer(max_records)
        self._task: asyncio.Task[None] | None = None
        router = getattr(session, "log_router", None)
        if router is not None:
            for record in router.recent_records():  # what was logged before the view opened (start-up)
                self.logs(record)
            router.add_listener(self.logs)

    def _start_task(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no running loop (a plain script before asyncio.run): refresh() by hand
        self._task = loop.create_task(self._run(), name="rlsdk-dashboard")

    async def _run(self) -> None:
        failures = 0
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.refresh()
                failures = 0
            except Exception:
                failures += 1
                if failures == 1:
                    logger.exception("dashboard refresh failed (the session is unaffected)")
                if failures >= 10:
                    return
            if self._session_closed() or self.logs.closed:
                return

    def _session_closed(self) -> bool:
        return bool(getattr(self.session, "closed", False))

    def _status(self) -> dict[str, Any]:
        return self.session.status()

    def _history(self) -> list[tuple[int, dict[str, float]]]:
        metrics = getattr(self.session, "metrics", None)
        return list(metrics.history) if metrics is not None else []

    def refresh(self, force: bool = False) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop refreshing and stop buffering logs (the session is unaffected)."""
        self.logs.closed = True
        router = getattr(self.session, "log_router", None)
        if router is not None:
            router.remove_listener(self.logs)
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if _open_views.get(id(self.session)) is self:
            _open_views.pop(id(self.session), None)


class Dashboard(_Refresher):
    """The ipywidgets dashboard. Display it as a cell's last expression; it updates by itself every ``interval_s``.

    Log filters: source (``all``, ``controller``, ``rank N``, ...), minimum level, component. ``widget`` is the
    root ``ipywidgets.VBox``.
    """

    def __init__(self, session: Any, *, interval_s: float = 1.0, max_records: int = 5000, max_lines: int = 200):
        import ipywidgets as widgets

        super().__init__(session, interval_s=interval_s, max_records=max_records)
        self.max_lines = max_lines
        self._title = widgets.HTML()
        self._ranks = widgets.HTML()
        self._versions = widgets.HTML()
        self._metrics = widgets.HTML()
        self._samples = widgets.HTML()
        self._logs = widgets.HTML()
        self._tracer = widgets.HTML()
        self._tracer.add_class("rlsdk-tracer")
        self._tracer_note = widgets.Label()
        self.trace_button = widgets.Button(description="trace now", tooltip="await session.trace()")
        self.keep_waiting_button = widgets.Button(
            description="keep waiting", tooltip="await session.keep_waiting()", button_style="warning"
        )
        self.terminate_button = widgets.Button(
            description="terminate ranks", tooltip="await session.close()", button_style="danger"
        )
        self.trace_button.on_click(lambda _b: self._spawn("trace", self._trace_now()))
        self.keep_waiting_button.on_click(lambda _b: self._spawn("keep waiting", self._keep_waiting()))
        self.terminate_button.on_click(lambda _b: self._spawn("terminate", self._terminate()))
        self._tasks: set[asyncio.Task[None]] = set()
        self._ranks.layout.margin = "0 24px 0 0"
        self._ranks.add_class("rlsdk-ranks")
        self._versions.add_class("rlsdk-versions")
        self._metrics.add_class("rlsdk-metrics")
        self._logs.add_class("rlsdk-logs")
        small = widgets.Layout(width="180px")
        self.source = widgets.Dropdown(options=[ALL], value=ALL, description="source", layout=small)
        self.level = widgets.Dropdown(options=list(LEVELS), value="INFO", description="level", layout=small)
        self.component = widgets.Dropdown(options=[ALL], value=ALL, description="component", layout=small)
        self._log_count = widgets.Label()
        for control in (self.source, self.level, self.component):
            control.observe(lambda _change: self._render_logs(), names="value")
        self.widget = widgets.VBox(
            [
                self._title,
                widgets.HBox([self._ranks, self._versions]),
                self._metrics,
                self._samples,
                widgets.HBox([self.source, self.level, self.component, self._log_count]),
                self._logs,
                widgets.HBox([self.trace_button, self.keep_waiting_button, self.terminate_button, self._tracer_note]),
                self._tracer,
            ]
        )
        self.widget.add_class("rlsdk-dashboard")
        self._seen_logs = -1
        self._seen_history = -1
        self._seen_trace: tuple[Any, ...] = ()
        self.refresh()
        self._start_task()

    # ---------------------------------------------------------------- tracer view actions (button clicks)
    def _spawn(self, what: str, coro: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:
            coro.close()
            self._tracer_note.value = f"{what}: no running event loop"
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _trace_now(self) -> None:
        self._tracer_note.value = "tracing..."
        try:
            report = await self.session.trace()
            self._tracer_note.value = "ranks agree" if report.ok else "divergence found"
        except Exception as exc:
            self._tracer_note.value = f"trace failed: {exc}"
        self.refresh()

    async def _keep_waiting(self) -> None:
        self._tracer_note.value = "waiting on the hung command..."
        try:
            await self.session.keep_waiting()
            self._tracer_note.value = "the hung command completed"
        except Exception as exc:
            self._tracer_note.value = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        self.refresh()

    async def _terminate(self) -> None:
        self._tracer_note.value = "terminating the ranks (closing the session)..."
        await self.session.close()
        self._tracer_note.value = "ranks terminated; the session is closed"
        self.refresh()

    def _render_tracer(self, status: dict[str, Any], force: bool) -> None:
        report = getattr(self.session, "last_trace", None)
        taken_at = getattr(self.session, "last_trace_time", None)
        hung = status.get("hung")
        diverged = (status.get("trace") or {}).get("diverged")
        key = (id(report), taken_at, diverged, None if hung is None else (hung["command"], int(hung["seconds"])))
        closed = bool(status.get("closed"))
        self.keep_waiting_button.layout.display = None if hung and not closed else "none"
        self.terminate_button.layout.display = None if hung and not closed else "none"
        self.trace_button.disabled = closed
        if force or key != self._seen_trace:
            self._seen_trace = key
            self._set(self._tracer, render_tracer_html(report, taken_at, hung, diverged))

    def _set(self, widget: Any, value: str) -> None:
        if widget.value != value:  # unchanged values send nothing to the front end
            widget.value = value

    def _render_logs(self) -> None:
        records = self.logs.snapshot()
        sources = sorted({record_source(r) for r in records}, key=lambda s: (s.startswith("rank"), s))
        components = sorted({str(r.get("component")) for r in records if r.get("component")})
        if [ALL, *sources] != list(self.source.options):
            self.source.options = [ALL, *sources]  # keeps the selected value when it is still offered
        if [ALL, *components] != list(self.component.options):
            self.component.options = [ALL, *components]
        shown = filter_records(
            records, source=self.source.value, min_level=self.level.value, component=self.component.value
        )
        self._set(self._logs, render_logs_html(shown, self.max_lines))
        self._set(self._log_count, f"{len(shown)} of {len(records)} buffered ({self.logs.total} received)")

    def refresh(self, force: bool = False) -> None:
        """Re-render from the session now. ``force`` re-sends every widget's state (for nbclient's saved output)."""
        status = self._status()
        closed = " (closed)" if status.get("closed") else ""
        output_dir = html.escape(str(getattr(self.session, "output_dir", "")))
        diverged = render_diverged_html((status.get("trace") or {}).get("diverged"))
        self._set(
            self._title,
            f"<b>rlsdk session</b>{closed} &middot; step {status.get('step')} &middot; {output_dir}{diverged}",
        )
        self._set(self._ranks, render_ranks_html(status))
        self._set(self._versions, render_versions_html(status))
        history = self._history()
        if force or len(history) != self._seen_history:
            self._seen_history = len(history)
            self._set(self._metrics, render_metrics_html(history))
            metrics = getattr(self.session, "metrics", None)
            self._set(self._samples, render_samples_html(dict(getattr(metrics, "texts", {}))))
        if force or self.logs.total != self._seen_logs:
            self._seen_logs = self.logs.total
            self._render_logs()
        self._render_tracer(status, force)
        if force:
            children = (self._title, self._ranks, self._versions, self._metrics, self._samples, self._logs,
                        self._log_count, self._tracer, self._tracer_note)  # fmt: skip
            for child in children:
                child.send_state()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)


class TextDashboard(_Refresher):
    """The terminal fallback: logs :meth:`Session.status_text` through the project logger every ``interval_s``."""

    def __init__(self, session: Any, *, interval_s: float = 30.0, max_records: int = 1000) -> None:
        super().__init__(session, interval_s=interval_s, max_records=max_records)
        self.last_text = ""
        self._start_task()

    def text(self) -> str:
        return format_status_text(self._status(), self._history())

    def refresh(self, force: bool = False) -> None:
        self.last_text = self.text()
        logger.info("status\n%s", self.last_text)

    def __repr__(self) -> str:
        return self.text()


def open_dashboard(
    session: Any,
    *,
    mode: Literal["auto", "widget", "text"] = "auto",
    interval_s: float | None = None,
    max_records: int = 5000,
    max_lines: int = 200,
) -> Dashboard | TextDashboard:
    """The widget dashboard in Jupyter (``auto``) or when asked (``widget``), the text one otherwise.

    ``interval_s`` defaults to 1 s for widgets and 30 s for text. Raises ``ImportError`` naming the ``notebook``
    extra when ``mode='widget'`` and ipywidgets is missing.
    """
    if mode not in ("auto", "widget", "text"):
        raise ValueError(f"dashboard mode must be 'auto', 'widget' or 'text', got {mode!r}")
    use_widget = mode == "widget" or (mode == "auto" and in_jupyter())
    if use_widget:
        try:
            import ipywidgets  # noqa: F401
        except ImportError as exc:
            if mode == "widget":
                raise ImportError("the dashboard needs ipywidgets: pip install 'rlsdk[notebook]'") from exc
            use_widget = False
    previous = _open_views.pop(id(session), None)
    if previous is not None:  # a re-run cell replaces the view instead of adding a second refresh task
        previous.close()
    view: Dashboard | TextDashboard
    if use_widget:
        view = Dashboard(session, interval_s=interval_s or 1.0, max_records=max_records, max_lines=max_lines)
    else:
        view = TextDashboard(session, interval_s=interval_s or 30.0, max_records=max_records)
    _open_views[id(session)] = view
    return view


# Weak: a view lives as long as the user's variable or its refresh task holds it.
_open_views: weakref.WeakValueDictionary[int, Dashboard | TextDashboard] = weakref.WeakValueDictionary()
