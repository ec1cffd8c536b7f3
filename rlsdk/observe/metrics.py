"""Step metrics to TensorBoard (``OUTPUT/tensorboard``) and a bounded in-memory history."""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Writes scalar metrics per step. ``tensorboard=False`` keeps only the in-memory history."""

    def __init__(
        self,
        log_dir: Path,
        *,
        tensorboard: bool,
        history: int = 100_000,
        dir_mode: int = 0o700,
        file_mode: int = 0o600,
    ) -> None:
        self.log_dir = log_dir
        self._writer: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            from rlsdk.runtime_dir import private_dir

            private_dir(log_dir, mode=dir_mode)
            before = set(os.listdir(log_dir))
            self._writer = SummaryWriter(log_dir=str(log_dir))
            for name in set(os.listdir(log_dir)) - before:  # the event file it opened under the process umask
                path = log_dir / name
                if path.is_file() and not path.is_symlink():
                    os.chmod(path, file_mode)
        self.history: deque[tuple[int, dict[str, float]]] = deque(maxlen=history)
        self.texts: dict[str, tuple[int, str]] = {}  # tag -> (step, text) of the latest log_text

    def log(self, step: int, metrics: Mapping[str, float | int]) -> None:
        """Record finite scalar ``metrics`` for ``step`` (names like ``reward/mean``, ``train/loss``)."""
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self.history.append((step, clean))
        if self._writer is not None and clean:
            from tensorboard.compat.proto.summary_pb2 import Summary

            # one event holding every scalar of the step (what add_scalar writes, one value per tag) instead of
            # one event and one queue put per scalar; readers see each tag at ``step`` as before
            summary = Summary(value=[Summary.Value(tag=name, simple_value=value) for name, value in clean.items()])
            self._writer._get_file_writer().add_summary(summary, step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        """Record ``text`` (Markdown) under ``tag`` for ``step``: TensorBoard's text tab, and ``texts[tag]`` (the
        latest one per tag, for the dashboard)."""
        self.texts[tag] = (step, text)
        if self._writer is not None:
            self._writer.add_text(tag, text, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
