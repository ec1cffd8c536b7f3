"""One helper for tearing down background tasks (watchers, prefetches, supervisors)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_quietly(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (None: nothing) and wait until it has finished, swallowing its cancellation or error.

    For a background task being torn down: whoever needed its outcome was told already (a failure is reported
    where it happens), and a teardown must go on whatever the task ended with.
    """
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
