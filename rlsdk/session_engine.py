"""The Session's inference engine slot: the engine built by the factory (:func:`rlsdk.engine.inference.build_engine`),
watched for an unexpected exit (a dead server becomes an error every later call raises, until
``Session.restart_engine`` replaces it), and the event-loop thread's torch thread count while the Session runs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from rlsdk.engine.inference.protocol import SessionEngine
from rlsdk.observe.logging import get_logger
from rlsdk.tasks import cancel_quietly

logger = get_logger("rlsdk.session")  # the Session's own messages, under its logger name as before


class EngineSlot:
    """Holds the Session's engine (``engine``) and its unexpected exit (``failure``); see the module docstring.

    ``build``: makes the configured engine; ``closing``: whether the run is closing (an exit then is expected)."""

    def __init__(self, build: Callable[[], Awaitable[SessionEngine]], *, closing: Callable[[], bool]) -> None:
        self.engine: SessionEngine | None = None
        self.failure: BaseException | None = None
        self.num_threads: int | None = None  # the embedded engine's default inference.embedded.num_threads
        self._build = build
        self._closing = closing
        self._watch: asyncio.Task[None] | None = None
        # Restores the event-loop thread's torch intra-op thread count (lowered to 1 while the Session runs).
        self._restore_threads: Callable[[], None] | None = None

    async def attach(self) -> None:
        """Build the configured engine and watch it for an unexpected exit."""
        self.engine = await self._build()
        self._watch = asyncio.get_running_loop().create_task(self._watch_failure(self.engine))

    async def _watch_failure(self, engine: SessionEngine) -> None:
        error = await engine.wait_failure()
        if self._closing() or self.engine is not engine:
            return
        self.failure = error
        logger.error("%s", self.failure)

    async def unwatch(self) -> None:
        await cancel_quietly(self._watch)
        self._watch = None

    async def stop(self) -> None:
        """Stop watching and close the engine, ignoring its errors (its server may be dead already)."""
        await self.unwatch()
        if self.engine is not None:
            with contextlib.suppress(Exception):
                await self.engine.close()

    async def replace(self) -> None:
        """Stop the engine (a dead server included) and attach a new one."""
        old = self.engine
        await self.stop()
        self.engine, self.failure = None, None
        logger.info("restarting the inference engine%s", "" if old is None else f" ({type(old).__name__})")
        await self.attach()

    def pin_threads(self) -> None:
        """Keep this thread's tensor ops single-threaded while the Session runs, so no OpenMP worker of this process
        spins on a core the ranks, the server or the engine's thread need (why: ``single_thread_caller``). The
        count before stays the default of an engine built later (restart)."""
        if self._restore_threads is not None:
            return
        import torch

        from rlsdk.engine.inference.embedded import single_thread_caller

        self.num_threads = torch.get_num_threads()
        self._restore_threads = single_thread_caller()

    def restore_threads(self) -> None:
        if self._restore_threads is not None:
            self._restore_threads()
            self._restore_threads = None
