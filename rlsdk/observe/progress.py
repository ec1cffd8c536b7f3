"""Progress bars for long Session calls (tqdm's notebook-aware bars: a widget in Jupyter, text in a terminal)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlsdk.observe.status import in_jupyter

# The phases of Session.start, in order (see Session._start).
START_PHASES: tuple[str, ...] = ("launching ranks", "loading engine, ranks connecting", "initialising ranks", "ready")


class PhaseProgress:
    """A bar over named phases: ``progress("phase")`` completes the previous phase and shows the new one.

    Disabled (a no-op) unless ``enabled``; ``None`` means enabled inside Jupyter only, so scripts and recipes,
    which draw their own bars, stay quiet.
    """

    def __init__(self, phases: Sequence[str], *, desc: str, enabled: bool | None = None) -> None:
        self.phases = list(phases)
        self._bar: Any = None
        if enabled is None:
            enabled = in_jupyter()
        if enabled:
            from tqdm.auto import tqdm

            try:
                self._bar = tqdm(total=len(self.phases), desc=desc, unit="phase", leave=True)
            except ImportError:  # tqdm.auto in a kernel without ipywidgets: plain text bar
                from tqdm import tqdm as text_tqdm

                self._bar = text_tqdm(total=len(self.phases), desc=desc, unit="phase", leave=True)
        self._done = 0

    def __call__(self, phase: str) -> None:
        if self._bar is None:
            return
        index = self.phases.index(phase) if phase in self.phases else self._done
        if index > self._done:
            self._bar.update(index - self._done)
            self._done = index
        self._bar.set_postfix_str(phase, refresh=True)
        if phase == self.phases[-1]:
            self._bar.update(len(self.phases) - self._done)
            self._done = len(self.phases)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
