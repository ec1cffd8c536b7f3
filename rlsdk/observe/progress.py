"""Progress bars for long Session calls (tqdm's notebook-aware bars: a widget in Jupyter, text in a terminal).

- :class:`PhaseProgress`: named phases (``Session.start``).
- :class:`CallProgress`: units of one call (samples of a rollout, micro-batches of an update), shown only once the
  call outlasts ``delay_s``: a loop of quick steps in a notebook creates no widgets at all. Counts come from a
  ``poll`` function (ranks' heartbeats) or from :func:`progress_sink`, a context variable that inference engines
  report finished samples to (so custom workflows get the bar without passing anything around).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

from rlsdk.observe.status import in_jupyter

_SINK: ContextVar[Callable[[int], None] | None] = ContextVar("rlsdk_progress_sink", default=None)


def progress_sink() -> Callable[[int], None] | None:
    """Where an engine reports ``n`` more finished samples of the current call (any thread); ``None`` when no
    progress bar listens. Read it in the coroutine (the context does not reach executor threads by itself)."""
    return _SINK.get()


def make_bar(**kwargs: Any) -> Any:
    """A ``tqdm.auto`` bar (a widget in Jupyter, text elsewhere) with ``kwargs``; text when ipywidgets is missing."""
    from tqdm.auto import tqdm

    try:
        return tqdm(**kwargs)
    except ImportError:  # tqdm.auto in a kernel without ipywidgets: plain text bar
        from tqdm import tqdm as text_tqdm

        return text_tqdm(**kwargs)


# The phases of Session.start, in order (see Session._start).
START_PHASES: tuple[str, ...] = (
    "launching ranks", "loading engine, ranks connecting", "initialising ranks", "verifying weights", "ready",
)  # fmt: skip


def format_seconds(seconds: dict[str, float]) -> str:
    """``name 1.2 s, other 0.3 s`` (in the mapping's order)."""
    return ", ".join(f"{name} {value:.1f} s" for name, value in seconds.items())


class PhaseProgress:
    """A bar over named phases: ``progress("phase")`` completes the previous phase and shows the new one, with
    the seconds each finished phase took (``seconds``, also kept when the bar is disabled).

    Disabled (a no-op bar) unless ``enabled``; ``None`` means enabled inside Jupyter only, so scripts and recipes,
    which draw their own bars, stay quiet.
    """

    def __init__(self, phases: Sequence[str], *, desc: str, enabled: bool | None = None) -> None:
        self.phases = list(phases)
        self.seconds: dict[str, float] = {}  # finished phase -> seconds it took
        self._bar: Any = None
        if enabled is None:
            enabled = in_jupyter()
        if enabled:
            self._bar = make_bar(total=len(self.phases), desc=desc, unit="phase", leave=True)
        self._done = 0
        self._current: tuple[str, float] | None = None

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        if self._current is not None:
            name, began = self._current
            self.seconds[name] = self.seconds.get(name, 0.0) + now - began
        self._current = (phase, now)
        if self._bar is None:
            return
        index = self.phases.index(phase) if phase in self.phases else self._done
        if index > self._done:
            self._bar.update(index - self._done)
            self._done = index
        if phase == self.phases[-1]:
            self._bar.set_postfix_str(f"{phase} ({format_seconds(self.seconds)})", refresh=True)
            self._bar.update(len(self.phases) - self._done)
            self._done = len(self.phases)
        else:
            done = f" (done: {format_seconds(self.seconds)})" if self.seconds else ""
            self._bar.set_postfix_str(f"{phase}{done}", refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class CallProgress:
    """A bar over the units of one long call, opened only after ``delay_s`` and refreshed every ``interval_s``
    from the running event loop (it never blocks it). Use as a context manager around the awaited work.

    Args:
        desc: the bar's label.
        total: units expected (``None``: unknown until ``poll`` says).
        unit: the unit's name.
        poll: returns ``(done, total)`` (e.g. summed over ranks' heartbeats) or ``None`` when nothing is known yet;
            without it, the count is what the call's engines report to :func:`progress_sink`.
        postfix: returns the text after the bar (versions, reward), read at every refresh.
        enabled: ``None`` shows bars inside Jupyter only (scripts draw their own); ``False`` disables.
    """

    def __init__(
        self,
        desc: str,
        *,
        total: int | None = None,
        unit: str = "it",
        poll: Callable[[], tuple[int, int] | None] | None = None,
        postfix: Callable[[], str] | None = None,
        enabled: bool | None = None,
        delay_s: float = 1.0,
        interval_s: float = 0.5,
    ) -> None:
        if delay_s < 0 or interval_s <= 0:
            raise ValueError(f"CallProgress needs delay_s >= 0 and interval_s > 0, got {delay_s}, {interval_s}")
        self.desc, self.total, self.unit = desc, total, unit
        self.poll, self.postfix = poll, postfix
        self.enabled = in_jupyter() if enabled is None else enabled
        self.delay_s, self.interval_s = delay_s, interval_s
        self.done = 0
        self._lock = threading.Lock()
        self._bar: Any = None
        self._timer: asyncio.TimerHandle | None = None
        self._token: Any = None

    @property
    def shown(self) -> bool:
        """Whether the bar was opened (the call outlasted ``delay_s``)."""
        return self._bar is not None

    def add(self, n: int) -> None:
        """``n`` more units done (any thread)."""
        with self._lock:
            self.done += n

    def __enter__(self) -> CallProgress:
        if self.enabled:
            self._token = _SINK.set(self.add)
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return self  # no loop: nothing can refresh a bar
            self._timer = loop.call_later(self.delay_s, self._tick)
        return self

    def __exit__(self, exc_type: object, *_rest: object) -> None:
        if self._token is not None:
            _SINK.reset(self._token)
            self._token = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._bar is not None:
            if exc_type is None:
                self._refresh(final=True)
            self._bar.close()
            self._bar = None

    def _counts(self) -> tuple[int, int | None]:
        if self.poll is not None:
            polled = self.poll()
            if polled is not None:
                return polled
            return 0, self.total
        with self._lock:
            return self.done, self.total

    def _refresh(self, *, final: bool = False) -> None:
        done, total = self._counts()
        if final and total is not None:
            done = total
        bar = self._bar
        if total is not None and bar.total != total:
            bar.total = total
        if done != bar.n:
            bar.n = done
        if self.postfix is not None:
            bar.set_postfix_str(self.postfix(), refresh=False)
        bar.refresh()

    def _tick(self) -> None:
        try:
            if self._bar is None:
                self._bar = make_bar(total=self.total, desc=self.desc, unit=self.unit, leave=False)
            self._refresh()
        finally:
            if self._timer is not None:  # still inside the call
                self._timer = asyncio.get_running_loop().call_later(self.interval_s, self._tick)


class Laps:
    """Seconds between successive marks, into ``into[name]`` (e.g. ``Session.close_seconds``); :meth:`total`
    records the seconds since the first."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into = into
        self.began = self._mark = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] = now - self._mark
        self._mark = now

    def total(self) -> None:
        self.into["total"] = time.perf_counter() - self.began
