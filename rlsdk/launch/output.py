"""Capture a child process's output: keep the last lines for error reports and hand each line on."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


async def pump_lines(
    stream: asyncio.StreamReader, last_lines: deque[str], on_line: Callable[[str], None] | None
) -> None:
    """Read ``stream`` to its end: append each decoded line to ``last_lines`` (bounded) and call ``on_line``."""
    while True:
        raw = await stream.readline()
        if not raw:
            return
        line = raw.decode(errors="replace").rstrip()
        last_lines.append(line)
        if on_line is not None:
            on_line(line)
