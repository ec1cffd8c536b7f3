"""Fault injection for checkpoint writing, run on real ranks through the ``call_function`` rank command.

Module level and importable by name: the test puts this directory on the ranks' PYTHONPATH.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

import torch

HANG_S = 300.0


def hang_mid_trainer_state_write(worker: Any, *, victim: int, marker: str) -> int:
    """On rank ``victim``: the next ``torch.save`` of ``trainer_state.pt`` writes half of its bytes (flushed and
    fsynced, the file still open), writes this rank's pid to ``marker`` and sleeps, so the test can SIGKILL the
    rank in the middle of writing a checkpoint. Other ranks are untouched. Returns the rank."""
    if worker.rank != victim:
        return worker.rank
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not str(f).endswith("trainer_state.pt"):
            real_save(obj, f, *args, **kwargs)
            return
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        with open(f, "wb") as handle:
            handle.write(data[: len(data) // 2])
            handle.flush()
            os.fsync(handle.fileno())
            Path(marker).write_text(str(os.getpid()))
            time.sleep(HANG_S)  # the test kills this rank here

    torch.save = save
    return worker.rank
