"""The processes of one Session run, supervised: logging and the rank log router, the private runtime and publish
directories, the control channel, the launcher and its rank processes, heartbeats, failure handling and close.

A :class:`RunSupervisor` turns every fault of the ranks (a process that exits, a rank that stops sending
heartbeats, a rank that raises while a peer waits for it in a collective) into one error remembered as
``failure``: every pending and later command fails with it, and every process of the run is stopped at once.
The Session (``rlsdk.session``) stays the facade a researcher holds; this module is its process half.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from rlsdk.engine.inference.vllm_worker import WEIGHTS_DIR_ENV
from rlsdk.engine.publish_dir import PublishDir
from rlsdk.observe.logging import ROOT_LOGGER, RankLogRouter, get_logger, set_log_context
from rlsdk.runtime_dir import output_modes, private_dir
from rlsdk.tasks import cancel_quietly

logger = get_logger("rlsdk.session")  # what the run reports, under the Session's logger name as before

# After a rank raised: how long its peers may take to leave the command before they count as stuck in a
# collective waiting for it.
RANK_ERROR_GRACE_S = 3.0


def rank_startup_seconds(launched: float, marks: Sequence[dict[str, float] | None]) -> dict[str, float]:
    """Where the ranks' start-up went, from the wall-clock marks each rank reports with ``init`` (see
    ``rlsdk.worker.main``) and ``launched`` (``time.time()`` when the launcher was started): the slowest rank's
    ``launcher`` (until its process existed: the launcher's imports and torchrun), ``rank_imports`` (Python and
    torch imports), ``rank_connect`` (control channel), ``process_group`` (rendezvous, accelerate) and
    ``train_engine`` (model and optimizer). Empty when a rank reported none (an older worker)."""
    if not marks or any(m is None for m in marks):
        return {}
    spans = {
        "launcher": ("launched", "process_start"),
        "rank_imports": ("process_start", "imported"),
        "rank_connect": ("imported", "connected"),
        "process_group": ("connected", "process_group"),
        "train_engine": ("init_begin", "init_end"),
    }
    out: dict[str, float] = {}
    for name, (first, last) in spans.items():
        values = [m[last] - (launched if first == "launched" else m[first]) for m in marks if m is not None]
        out[f"ranks/{name}"] = max(values)
    return out


class TrainerRanks:
    """The run's train ranks as an engine sees them (:class:`~rlsdk.engine.inference.protocol.TrainerHandle`)."""

    def __init__(self, run: RunSupervisor) -> None:
        self.run = run

    @property
    def commands_sent(self) -> int:
        return self.run.broadcasts

    async def broadcast(
        self, command: str, body: dict[str, Any] | list[dict[str, Any]] | None = None, *, timeout_s: float | None
    ) -> list[Any]:
        return await self.run.broadcast(command, body, timeout_s=timeout_s)

    async def export_weights(self) -> dict[str, Any]:
        body = {"publish_dir": self.run.publish_dir, "src": 0}
        results = await self.run.broadcast("export_weights", body, timeout_s=self.run.config.launch.command_timeout_s)
        return dict(results[0])


class RunSupervisor:
    """The rank processes of one run and everything that watches them.

    ``on_failure``: awaited once after a fatal fault stopped the ranks (the Session stops what it runs on top:
    a background rollout, the engine). ``on_trace``: receives the hang watchdog's reports (``launch.tracer``).
    """

    def __init__(
        self,
        config: Any,
        output_dir: Path,
        *,
        on_failure: Callable[[], Awaitable[None]],
        on_trace: Callable[[Any], None],
    ) -> None:
        self.config = config
        self.output_dir = output_dir
        self.rank_info: dict[int, dict[str, Any]] = {}
        self.router: RankLogRouter | None = None
        self.channel: Any = None
        self.launcher: Any = None
        self.publish: PublishDir | None = None
        self.publish_dir: str | None = None
        self.device_plan: Any = None  # rlsdk.config.device.DevicePlan of the running ranks (set by open_channel)
        self.runtime_dir: Any = None  # SessionRuntimeDir: private sockets and rendezvous files of one start
        self.failure: BaseException | None = None
        self.closing = False
        self.broadcasts = 0  # commands sent through broadcast() so far
        self._log_handler: logging.Handler | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._liveness: asyncio.Task[None] | None = None
        self._on_failure = on_failure
        self._on_trace = on_trace

    # ------------------------------------------------------------------ start
    def open_logs(self, early_records: Sequence[logging.LogRecord]) -> None:
        """Create the private output directories and route this process's and the ranks' records to
        ``OUTPUT/logs``; ``early_records`` (logged by the pre-start checks) are shown first."""
        cfg = self.config
        dir_mode, file_mode = output_modes(cfg.observe.output_mode)
        private_dir(self.output_dir, mode=dir_mode)  # 0700 by default: no other user reads logs or checkpoints
        for sub in ("traces", "checkpoints"):
            private_dir(self.output_dir / sub, mode=dir_mode)
        level = logging.getLevelName(cfg.observe.log_level)
        self.router = RankLogRouter(
            self.output_dir / "logs", console=cfg.observe.console, level=level, dir_mode=dir_mode, file_mode=file_mode
        )
        self._log_handler = self.router.controller_handler()
        root = logging.getLogger(ROOT_LOGGER)
        root.addHandler(self._log_handler)
        root.setLevel(level)
        set_log_context(rank=None, world_size=cfg.launch.num_ranks, version=0, role="controller")
        for record in early_records:
            self._log_handler.handle(record)

    async def open_channel(self) -> dict[str, Any]:
        """Create the private runtime and publish directories and start the control channel; returns the ranks'
        environment (``rank_environment``: address, secret, heartbeats, threads, ...)."""
        from rlsdk.control.protocol import new_session_secret
        from rlsdk.launch.local import rank_environment
        from rlsdk.launch.rendezvous import control_host, one_machine_environment
        from rlsdk.preflight import device_plan
        from rlsdk.runtime_dir import SessionRuntimeDir

        cfg = self.config
        # Private (0700) home of the session's Unix sockets (control channel, a started vLLM server) and the ranks'
        # rendezvous files; removed by close().
        self.runtime_dir = SessionRuntimeDir()
        # Before the launcher: a vLLM replica the job starts loads weights only from here. Swept by the next
        # Session if this process is killed before close() removes it (see publish_dir).
        self.publish = PublishDir()
        self.publish_dir = self.publish.path
        secret = new_session_secret()
        session_id = uuid.uuid4().hex[:12]
        host = control_host(cfg.launch)  # None: a Unix socket in the runtime directory, no TCP port
        channel_cls, channel_kwargs = self._channel_kind()
        assert self.router is not None
        self.channel = channel_cls(
            secret,
            session_id,
            host=host,
            socket_dir=None if host is not None else self.runtime_dir.path,
            heartbeat_interval_s=cfg.launch.heartbeat_interval_s,
            on_log=self.router.handle,
            **channel_kwargs,
        )
        await self.channel.start()
        dir_mode, _ = output_modes(cfg.observe.output_mode)
        self.device_plan = device_plan(cfg)
        return rank_environment(
            os.environ,
            {
                "RLSDK_CONTROL_ADDR": self.channel.address,
                "RLSDK_SESSION_SECRET": secret.hex(),
                "RLSDK_SESSION_ID": session_id,
                "RLSDK_HEARTBEAT_INTERVAL_S": cfg.launch.heartbeat_interval_s,
                "RLSDK_HEARTBEAT_TIMEOUT_S": cfg.launch.heartbeat_timeout_s,
                "RLSDK_THREADS_PER_RANK": cfg.launch.threads_per_rank,
                "RLSDK_LOG_LEVEL": logging.getLevelName(cfg.observe.log_level),
                "OMP_NUM_THREADS": cfg.launch.threads_per_rank,
                "RLSDK_TRACER": int(cfg.launch.tracer),
                "RLSDK_SHM_ALLREDUCE": int(cfg.launch.shm_allreduce),
                "RLSDK_PG_TIMEOUT_S": "" if cfg.launch.pg_timeout_s is None else cfg.launch.pg_timeout_s,
                "RLSDK_TRACE_DIR": self.output_dir / "traces" / "live",
                WEIGHTS_DIR_ENV: self.publish_dir,  # for vLLM replicas a cluster job starts
                "RLSDK_UMASK": oct(0o777 & ~dir_mode),  # what the ranks write gets observe.output_mode
                **(one_machine_environment(self.runtime_dir.path) if cfg.launch.scheduler == "local" else {}),
                **self.device_plan.rank_environment(tracer=cfg.launch.tracer),  # RLSDK_DEVICE, the ranks' GPUs
            },
        )

    def _channel_kind(self) -> tuple[type, dict[str, Any]]:
        """The control channel class: with ``launch.tracer``, the hang watchdog's (see rlsdk/debug/watchdog.py)."""
        from rlsdk.control.controller import ControllerChannel

        cfg = self.config
        if not cfg.launch.tracer:
            return ControllerChannel, {}
        from rlsdk.debug.watchdog import WatchedControllerChannel

        return WatchedControllerChannel, {
            "hang_timeout_s": cfg.launch.hang_timeout_s,
            "hang_policy": cfg.launch.hang_policy,
            "traces_dir": self.output_dir / "traces",
            "world_size": cfg.launch.num_ranks,
            "on_report": self._on_trace,
            "trace_poll_s": cfg.launch.trace_poll_s,
        }

    async def launch(self, env: dict[str, Any]) -> None:
        """Start the launcher (and with it the rank processes) and supervise its exit."""
        from rlsdk.engine.inference.factory import replica_server
        from rlsdk.launch.select import start_launcher

        self.launcher = await start_launcher(
            self.config.launch,
            env,
            output_dir=self.output_dir,
            on_line=self.launcher_line,
            replica_server=replica_server(self.config),  # a batch launcher runs it on nodes of its own
        )
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def init_ranks(self, init: dict[str, Any], *, on_connected: Callable[[], None]) -> list[dict[str, Any]]:
        """Wait for every rank to connect, send them ``init`` and return their results (index = rank); from then
        on a rank without heartbeats fails the run."""
        cfg = self.config.launch
        self.rank_info = await self.channel.wait_for_ranks(cfg.num_ranks, cfg.start_timeout_s)
        self.launcher.rank_pids = [info["pid"] for info in self.rank_info.values()]
        on_connected()
        results = await self.channel.broadcast("init", init, timeout_s=cfg.start_timeout_s)
        # Liveness from here on: during start-up the ranks import and load while holding the GIL for long
        # stretches (their heartbeats wait), and launch.start_timeout_s bounds it.
        self._liveness = asyncio.get_running_loop().create_task(self._watch_heartbeats())
        return results

    async def start_ranks(
        self,
        early_records: Sequence[logging.LogRecord],
        init: dict[str, Any],
        *,
        alongside: Callable[[], Awaitable[None]],
        phase: Callable[[str], None],
        seconds: dict[str, float],
    ) -> list[dict[str, Any]]:
        """Open the logs and the channel, launch the ranks and initialise them with ``init``; returns their results
        (index = rank). ``alongside`` runs while the ranks import torch and form their process group (the engine
        loads) and is awaited before this returns; ``phase`` names the start-up's steps (a progress bar);
        ``seconds`` receives the set-up time and the ranks' own start-up (:func:`rank_startup_seconds`)."""
        t0 = time.perf_counter()
        self.open_logs(early_records)  # the records the pre-start checks logged come first
        env = await self.open_channel()
        phase("launching ranks")
        seconds["setup"] = time.perf_counter() - t0
        launched = time.time()
        await self.launch(env)
        task = asyncio.get_running_loop().create_task(alongside())
        try:
            phase("loading engine, ranks connecting")
            results = await self.init_ranks(init, on_connected=lambda: phase("initialising ranks"))
            seconds.update(rank_startup_seconds(launched, [r.pop("startup", None) for r in results]))
        finally:
            await task
        return results

    def engine_context(self, special_tokens: Any, engine_version: Callable[[], int], num_threads: int | None) -> Any:
        """What the engine factory needs of the run (:class:`~rlsdk.engine.inference.EngineContext`): the trainer
        handle, the launcher (a replica a cluster job started), the private directories, and where the server's
        output lines go (tagged with ``engine_version()``, the version served then)."""
        from rlsdk.engine.inference import EngineContext

        return EngineContext(
            config=self.config,
            special_tokens=special_tokens,
            trainer=TrainerRanks(self),
            launcher=self.launcher,
            runtime_dir=None if self.runtime_dir is None else self.runtime_dir.path,
            publish_dir=self.publish_dir,
            on_line=lambda line: self.inference_line(line, version=engine_version()),
            num_threads=num_threads,
            device_plan=self.device_plan,
        )

    # ------------------------------------------------------------------ child output
    def route_child_line(self, line: str, *, role: str, component: str, level: str, version: int | None) -> None:
        """Show a line a child process printed (launcher, inference server) in the rank-tagged log stream."""
        if self.router is None or not line.strip():
            return
        self.router.handle(
            {
                "time": time.time(),
                "level": level,
                "levelno": logging.getLevelName(level),
                "logger": f"rlsdk.{role}",
                "component": component,
                "rank": None,
                "world_size": self.config.launch.num_ranks,
                "version": version,
                "role": role,
                "message": line,
            }
        )

    def inference_line(self, line: str, *, version: int) -> None:
        """A line the inference server printed, at the level its own logger gave it."""
        level = next((name for name in ("ERROR", "WARNING", "CRITICAL") if f" {name} " in line), "INFO")
        self.route_child_line(line, role="inference", component="vllm", level=level, version=version)

    def launcher_line(self, line: str) -> None:
        self.route_child_line(line, role="launcher", component="launch", level="INFO", version=None)

    def rank_log_tail(self, rank: int, count: int = 20) -> list[str]:
        """The last ``count`` log records rank ``rank`` shipped, as ``LEVEL message`` lines."""
        if self.router is None:
            return []
        records = [r for r in self.router.recent_records() if r.get("rank") == rank]
        return [f"{r.get('level')} {r.get('message')}" for r in records[-count:]]

    def command_progress(self, command: str) -> tuple[int, int] | None:
        """Steps done / total of ``command``, summed over the ranks whose heartbeat reports it running."""
        current = self.channel.current_commands()
        reported = [p for rank, p in self.channel.command_progress().items() if p and current.get(rank) == command]
        if not reported:
            return None
        return sum(done for done, _ in reported), sum(total for _, total in reported)

    def rank_status(self, *, running: bool) -> dict[int, dict[str, Any]]:
        """Per rank: pid, heartbeat age, current command and its ``(done, total)`` progress, and whether it is
        alive (``running``: the Session is not closed)."""
        from rlsdk.observe.status import rank_alive

        channel = self.channel
        ages = channel.heartbeat_ages() if channel is not None else {}
        current = channel.current_commands() if channel is not None else {}
        progress = channel.command_progress() if channel is not None else {}
        timeout_s = self.config.launch.heartbeat_timeout_s
        return {
            rank: {
                "pid": info.get("pid"),
                "heartbeat_age_s": ages.get(rank),
                "command": current.get(rank),
                "progress": progress.get(rank),
                "alive": running and rank_alive(info.get("pid"), ages.get(rank), timeout_s),
            }
            for rank, info in self.rank_info.items()
        }

    # ------------------------------------------------------------------ faults
    async def _supervise(self) -> None:
        """Turn an unexpected exit of the rank processes into an error for whoever waits on them."""
        await self.launcher.wait()
        if self.closing:
            return
        await self.fail(self.launcher.error(rank_log_lines=self.rank_log_tail))

    async def _watch_heartbeats(self) -> None:
        """Fail the run when a rank sends no heartbeat for ``launch.heartbeat_timeout_s`` (stopped, hung holding
        the GIL, swapped out): its peers would wait for it forever in their next collective."""
        from rlsdk.control.errors import RankUnresponsiveError

        cfg = self.config.launch
        period = min(cfg.heartbeat_interval_s, 1.0)
        loop = asyncio.get_running_loop()
        while not self.closing and self.failure is None:
            before = loop.time()
            await asyncio.sleep(period)
            if loop.time() - before > period + cfg.heartbeat_timeout_s / 2:
                continue  # this event loop was blocked (a long synchronous cell): let queued heartbeats in first
            current = self.channel.current_commands()
            for rank, age in self.channel.heartbeat_ages().items():
                if age > cfg.heartbeat_timeout_s:
                    pid = self.rank_info.get(rank, {}).get("pid")
                    error = RankUnresponsiveError(
                        rank, pid, age, cfg.heartbeat_timeout_s, current.get(rank), self.rank_log_tail(rank)
                    )
                    await self.fail(error)
                    return

    def _cancel_hung(self) -> None:
        """Stop waiting on a command the hang watchdog reported hung (its ranks are being stopped)."""
        hung = getattr(self.channel, "hung", None)
        if hung is not None:
            hung.task.cancel()
            self.channel.hung = None

    async def fail(self, error: BaseException) -> None:
        """A fatal fault: remember it, fail every waiting call with it, and stop every process of the run at once
        (SIGKILL: a failed run has nothing to flush). The Session stays usable through ``restart``."""
        if self.closing or self.failure is not None:
            return
        self.failure = error
        logger.error("%s", error)
        self.channel.fail_pending(error)
        self._cancel_hung()
        if self.launcher is not None:
            for pid in self.launcher.rank_pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            await self.launcher.stop(grace_s=3.0)
        await self._on_failure()
        logger.error("every process of the run was stopped; `await session.restart()` resumes from the last checkpoint")

    async def broadcast(
        self, command: str, body: dict[str, Any] | list[dict[str, Any]] | None = None, *, timeout_s: float | None
    ) -> list[Any]:
        """``channel.broadcast``, failing the run when a rank raised while another is still inside the command."""
        from rlsdk.control.errors import RankDisconnectedError, RankError

        self.broadcasts += 1
        try:
            return await self.channel.broadcast(command, body, timeout_s=timeout_s)
        except RankDisconnectedError as exc:
            # A rank process is gone before its launcher exited: let the supervisor name the rank and its signal.
            if self._supervisor is not None and self.failure is None:
                with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(self._supervisor), timeout=10.0)
            if self.failure is not None:
                raise self.failure from exc
            raise
        except RankError as exc:
            await self._after_rank_error(exc)
            if self.failure is not None and self.failure is not exc:
                raise self.failure from exc  # the root cause (a rank died), not its peer's broken connection
            raise

    async def _after_rank_error(self, exc: Any) -> None:
        """After rank ``exc.rank`` raised in ``exc.command``: if every rank left the command (all raised, or the
        others finished) the ranks are still in step and the Session stays usable. A rank still inside it after
        a grace period (:data:`RANK_ERROR_GRACE_S`) is waiting for the failed one in a collective and never
        returns, and a rank that does not answer at all has died: either way the run is failed and stopped, and
        the error says so."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RANK_ERROR_GRACE_S
        inside: list[int] = []
        while self.failure is None:
            inside = await self._ranks_inside(exc)
            if inside is None or not inside:
                return
            if loop.time() >= deadline:
                break
            await asyncio.sleep(0.1)
        if self.failure is not None:
            return
        exc.add_note(
            f"rank(s) {inside} were still inside {exc.command!r} (or not answering) {RANK_ERROR_GRACE_S:g} s later, "
            f"waiting for rank {exc.rank} in a collective it will never join: every process of the run was "
            "stopped. `await session.restart()` resumes from the last checkpoint."
        )
        await self.fail(exc)

    async def _ranks_inside(self, exc: Any) -> list[int] | None:
        """The ranks other than ``exc.rank`` still inside ``exc``'s command, or not reached by it yet (they will
        enter, and wait), or not answering; None when the query itself failed."""
        from rlsdk.control.protocol import CURRENT_QUERY

        try:  # the ranks' event threads answer even while their main thread is stuck in a collective
            answers = await self.channel.query_events(CURRENT_QUERY, timeout_s=1.0)
        except Exception:
            return None
        return [
            rank
            for rank in range(self.config.launch.num_ranks)
            if rank != exc.rank
            and (
                rank not in answers
                or (
                    isinstance(answers[rank], dict)
                    and (answers[rank].get("seq") == exc.seq or answers[rank].get("received", exc.seq) < exc.seq)
                )
            )
        ]

    # ------------------------------------------------------------------ hangs (see rlsdk/debug)
    async def trace(self, timeout_s: float) -> Any:
        """Every rank's collective trace and thread stacks, compared now (a ``TraceReport``, also given to
        ``on_trace``). The watchdog's channel (``launch.tracer``) traces itself; else stacks only."""
        from rlsdk.debug.analyze import analyze
        from rlsdk.debug.watchdog import collect_states

        if hasattr(self.channel, "trace"):  # the watchdog's channel: it reports to on_trace
            return await self.channel.trace(timeout_s=timeout_s)
        states = await collect_states(
            self.channel, self.config.launch.num_ranks, timeout_s, tail_dir=self.output_dir / "traces" / "live"
        )
        report = await asyncio.to_thread(analyze, states)
        self._on_trace(report)
        return report

    def hung_command(self) -> Any:
        """The command the hang watchdog reported while it is still pending on the ranks; None otherwise."""
        hung = getattr(self.channel, "hung", None)
        if hung is not None and hung.task.done():
            return None
        return hung

    async def keep_waiting(self, timeout_s: float | None) -> list[Any]:
        """Wait on the hung command (still watched); see ``Session.keep_waiting``."""
        if not hasattr(self.channel, "keep_waiting"):
            raise RuntimeError("keep_waiting needs the hang watchdog (launch.tracer=True and launch.hang_timeout_s)")
        return await self.channel.keep_waiting(timeout_s)

    # ------------------------------------------------------------------ close
    async def stop_ranks(self) -> None:
        """Ask the ranks to shut down, wait briefly for the launcher, stop it; then stop watching them."""
        self.closing = True
        self._cancel_hung()  # terminating a hung command: its ranks are shut down here
        if self.channel is not None:
            with contextlib.suppress(Exception):
                await self.channel.shutdown_ranks()
        if self.launcher is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.launcher.proc.wait()), timeout=5.0)
            await self.launcher.stop()

    async def close_channel(self) -> None:
        await cancel_quietly(self._liveness)
        await cancel_quietly(self._supervisor)
        if self.channel is not None:
            await self.channel.close()

    def remove_dirs(self) -> None:
        if self.publish is not None:
            self.publish.remove()
        if self.runtime_dir is not None:
            self.runtime_dir.remove()

    def close_logs(self) -> None:
        if self._log_handler is not None:
            logging.getLogger(ROOT_LOGGER).removeHandler(self._log_handler)
        if self.router is not None:
            self.router.close()
