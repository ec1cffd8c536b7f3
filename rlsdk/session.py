"""Session: the one object a researcher holds. It composes launch, control, the inference engine, the workflow,
rewards, versioning and observability, and exposes the RL step as four awaitable calls::

    session = await Session.start(config)          # ranks + engine up, both at v0 (checked by checksum)
    rollout = await session.rollout()               # samples carry behaviour version v0
    rollout = await session.reward(rollout, fn)     # rewards on the rollout
    stats   = await session.update(rollout)         # ranks train; the trainer publishes v1
    await session.sync_weights()                    # engine serves v1, verified by version and checksum
    await session.close()                           # nothing of the run is left alive

The same calls work from Jupyter (top-level ``await``) and from a script (``asyncio.run``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlsdk.config import SessionConfig, config_to_dict
from rlsdk.engine.inference.protocol import InferenceEngine, SamplingParams, SessionEngine, WeightInfo
from rlsdk.observe.logging import RankLogRouter, capture_records, get_logger, set_log_context
from rlsdk.observe.metrics import MetricsWriter
from rlsdk.observe.rollout_metrics import (
    completion_metrics,
    current_rows_B_C,
    reward_metrics,
    samples_markdown,
    throughput_metrics,
)
from rlsdk.observe.status import last_batch_staleness
from rlsdk.preflight import check_before_start, check_special_tokens
from rlsdk.preflight import check_data as check_data  # re-exported: imported from here before rlsdk.preflight
from rlsdk.preflight import check_model_dir as check_model_dir
from rlsdk.preflight import check_model_files as check_model_files
from rlsdk.preflight import load_resume_state as load_resume_state
from rlsdk.rewards.apply import RewardFn, compute_reward_breakdown
from rlsdk.runtime_dir import output_modes, private_dir, restrict_tree
from rlsdk.supervisor import RunSupervisor
from rlsdk.supervisor import rank_startup_seconds as rank_startup_seconds  # re-exported: it lived here
from rlsdk.tasks import cancel_quietly
from rlsdk.versioning import VersionError, VersionLedger, staleness_mask
from rlsdk.workflow.rollout import Rollout, normalize_rows
from rlsdk.workflow.single_turn import RolloutWorkflow, SingleTurnWorkflow

logger = get_logger("rlsdk.session")


class SessionClosedError(RuntimeError):
    """The Session was closed (or failed to start); start a new one."""


class _Ranks:
    """The Session's train ranks as an engine sees them (:class:`~rlsdk.engine.inference.protocol.TrainerHandle`)."""

    def __init__(self, session: Session) -> None:
        self._session = session

    @property
    def commands_sent(self) -> int:
        return self._session._broadcasts

    async def broadcast(
        self, command: str, body: dict[str, Any] | list[dict[str, Any]] | None = None, *, timeout_s: float | None
    ) -> list[Any]:
        return await self._session._broadcast(command, body, timeout_s=timeout_s)

    async def export_weights(self) -> dict[str, Any]:
        session = self._session
        body = {"publish_dir": session._publish_dir, "src": 0}
        results = await session._broadcast("export_weights", body, timeout_s=session.config.launch.command_timeout_s)
        return dict(results[0])


class Session:
    """A live RL session: background train ranks, an inference engine, and the version ledger.

    Create with ``await Session.start(config)``; close with ``await session.close()`` or ``async with``.
    """

    def __init__(self, config: SessionConfig) -> None:
        self.config = config
        self.output_dir = Path(config.observe.output_dir)
        self.versions = VersionLedger()
        self.step = 0
        self.rank_info: dict[int, dict[str, Any]] = {}
        self.engine: SessionEngine | None = None
        self.tokenizer: Any = None
        self.workflow: RolloutWorkflow | None = None
        self._default_workflow: RolloutWorkflow | None = None  # the one start() made; restart() keeps any other
        self.prompt_sampler: Any = None
        self._dataset: Any = None  # built by start() (check_data) before any process starts
        self.metrics: MetricsWriter | None = None
        # The processes of the run: channel, launcher, log router, heartbeats, failures (rlsdk.supervisor).
        self._run = self._new_run()
        # The model's pad and EOS ids (rlsdk.engine.inference.stopping), resolved by start() before any process
        # starts: the engines, the default workflow and the rollout joining (dynamic sampling) all use these.
        self.special_tokens: Any = None
        self._prefetch: asyncio.Task[Rollout] | None = None  # rollout.mode='async': the batch being generated
        self._prefetch_state: tuple[dict[str, Any], int] | None = None  # (data position, rollouts) before it
        # inference.lookahead: (the next batch's rows, the data position before them), drawn by update() for the
        # ranks to sample right after it; the next default rollout() or next_prompts() takes these rows.
        self._lookahead: tuple[list[dict[str, Any]], dict[str, Any]] | None = None
        self._engine_watch: asyncio.Task[None] | None = None
        # Restores the event-loop thread's torch intra-op thread count (lowered to 1 while the Session runs).
        self._restore_threads: Callable[[], None] | None = None
        self._engine_threads: int | None = None  # the embedded engine's default inference.num_threads
        self._engine_failure: BaseException | None = None
        self._rollouts = 0  # rollouts sampled so far; each one's seed derives from it (see rollout())
        self._resume: tuple[Path, dict[str, Any]] | None = None  # (checkpoint, controller state), see start()
        self.resumed_from: Path | None = None  # the checkpoint this session continued from
        self._closed = False
        self._phase: Any = lambda _phase: None  # progress hook of start(); see rlsdk.observe.progress
        self.last_trace: Any = None  # the latest TraceReport (watchdog or trace()); the dashboard's tracer view
        self.last_trace_time: float | None = None  # time.time() of last_trace
        self._early_records: list[logging.LogRecord] = []  # see start(): shown once logging is set up
        self._entropy_checked = False  # see _check_entropy_bonus
        self._held_out: dict[int | None, list[dict[str, Any]]] = {}  # evaluate(None, ...)'s rows by num_prompts
        # Seconds each part of start() and close() took (see rank_startup_seconds): the start bar's phases, the
        # ranks' own start-up, the overlapped engine load; benchmarks/session_overhead.py reports them.
        self.start_seconds: dict[str, float] = {}
        self.close_seconds: dict[str, float] = {}

    def _new_run(self) -> RunSupervisor:
        return RunSupervisor(
            self.config, self.output_dir, on_failure=self._after_run_failed, on_trace=self._record_trace
        )

    # The run's process half, under the names the Session's own code, tests and the dashboard used before it
    # moved to rlsdk.supervisor.
    @property
    def _channel(self) -> Any:
        return self._run.channel

    @property
    def _launcher(self) -> Any:
        return self._run.launcher

    @_launcher.setter
    def _launcher(self, launcher: Any) -> None:
        self._run.launcher = launcher

    @property
    def _router(self) -> RankLogRouter | None:
        return self._run.router

    @property
    def _publish_dir(self) -> str | None:
        return self._run.publish_dir

    @property
    def _runtime_dir(self) -> Any:
        return self._run.runtime_dir

    @property
    def _broadcasts(self) -> int:
        return self._run.broadcasts

    @property
    def _failure(self) -> BaseException | None:
        return self._run.failure

    @property
    def _closing(self) -> bool:
        return self._run.closing

    # ------------------------------------------------------------------ start / close
    @classmethod
    async def start(cls, config: SessionConfig, *, progress: bool | None = None) -> Session:
        """Start the train ranks and the inference engine; return when both serve weight version 0, or, with
        ``train.resume_from``, the checkpoint's version N (weights, optimizer, ranks' RNG states, version ledger,
        data position and rollout seeds restored, the engine synced to the trainer and verified).

        Raises ``ConfigError`` for a bad model path, data set or ``train.resume_from`` checkpoint (before any
        process starts, see :func:`check_data` and :func:`load_resume_state`), ``TimeoutError`` when ranks do not
        connect within ``launch.start_timeout_s``, ``RankProcessError`` when they exit during start-up (with their
        last output lines), ``RankError`` when a rank raises, ``WeightMismatchError`` when the engine's initial
        weights differ from the trainer's (or a resumed trainer's from the checkpoint's recorded checksum).
        ``progress`` shows a bar over the start phases (``None``: in Jupyter only).
        """
        if not isinstance(config, SessionConfig):
            raise TypeError(f"Session.start needs a SessionConfig, got {type(config).__name__}")
        began = time.perf_counter()
        with capture_records(config.observe.log_level) as early:
            checked = await check_before_start(config)
        session = cls(config)
        session._early_records = early
        session.start_seconds["checks"] = time.perf_counter() - began
        await session._start_checked(checked, progress=progress, desc="Session.start")
        return session

    async def _start_checked(
        self, checked: tuple[tuple[Path, dict[str, Any]] | None, Any, Any, Any], *, progress: bool | None, desc: str
    ) -> None:
        from rlsdk.observe.progress import START_PHASES, PhaseProgress

        self._resume, self._dataset, self.tokenizer, self.special_tokens = checked
        phases = self._phase = PhaseProgress(START_PHASES, desc=desc, enabled=progress)
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        finally:
            phases.close()
            self._phase = lambda _phase: None
        # The bar's phases (wall time on the controller), then where the ranks spent theirs (rank_startup_seconds).
        self.start_seconds.update({f"phase/{name}": value for name, value in phases.seconds.items()})

    async def restart(self, *, resume_from: str | None = "latest", progress: bool | None = None) -> Path | None:
        """Stop every process of the run (failed, hung or healthy ranks, the inference server) and start new ones,
        continuing from a checkpoint; the same Session object stays in use (notebook variables, the dashboard and a
        custom ``workflow`` keep working). Returns the checkpoint resumed from (``None``: started over).

        ``resume_from``: ``'latest'`` (the newest complete checkpoint under ``OUTPUT/checkpoints``), a ``step_N``
        directory, or ``None`` to start over from ``model.path`` at version 0. Steps after that checkpoint are
        lost; the weight version, data position and sampling seeds continue from it exactly.

        Raises ``ConfigError`` naming ``train.resume_from`` when there is no such complete checkpoint, before
        anything is stopped; then the errors of :meth:`start`.
        """
        config = dataclasses.replace(self.config, train=dataclasses.replace(self.config.train, resume_from=resume_from))
        with capture_records(config.observe.log_level) as early:
            checked = await check_before_start(config)
        workflow = self.workflow if self.workflow is not self._default_workflow else None
        logger.warning(
            "restarting the session: stopping every process of the run%s",
            "" if self._failure is None else f" after: {str(self._failure).splitlines()[0]}",
        )
        listeners = list(self._router._listeners) if self._router is not None else []  # e.g. a dashboard's
        await self.close()
        fresh = type(self)(config)
        self.__dict__.update(fresh.__dict__)  # keep this object (and whoever holds it), with a new start's state
        self._run = self._new_run()  # its hooks call this object, not `fresh`
        self._early_records = early
        await self._start_checked(checked, progress=progress, desc="Session.restart")
        for listener in listeners:
            self._router.add_listener(listener)
        if workflow is not None:
            self.workflow = workflow
        return self.resumed_from

    async def _start(self) -> None:
        cfg = self.config
        t0 = time.perf_counter()
        self._run.open_logs(self._early_records)  # the records the pre-start checks logged come first
        self._early_records = []
        env = await self._run.open_channel()
        self._phase("launching ranks")
        self.start_seconds["setup"] = time.perf_counter() - t0
        launched = time.time()
        await self._run.launch(env)

        # The engine loads while the ranks import torch and form their process group.
        engine_task = asyncio.get_running_loop().create_task(self._start_engine())
        try:
            self._phase("loading engine, ranks connecting")
            init: dict[str, Any] = {"config": config_to_dict(cfg)}
            if self._resume is not None:
                init["resume_from"] = str(self._resume[0])
            results = await self._run.init_ranks(init, on_connected=lambda: self._phase("initialising ranks"))
            self.rank_info = self._run.rank_info
            self.start_seconds.update(rank_startup_seconds(launched, [r.pop("startup", None) for r in results]))
        finally:
            await engine_task
        trainer = results[0]
        self._phase("verifying weights")
        if self._resume is not None:
            self._restore(self._resume[0], self._resume[1], trainer)
        self.versions.trainer_checksum = trainer["checksum"]
        # The engine checks what it loaded against the trainer's v0 where it can, else the trainer's weights are
        # published and verified like every later sync (a resumed trainer is at the checkpoint's version).
        verified = await self._engine().verify_initial(trainer, resumed=self._resume is not None)
        if verified is None:
            await self.sync_weights()
        else:
            self.versions.record_sync(verified.version, verified.checksum, 0.0)
        self._phase("ready")
        self.start_seconds["total"] = time.perf_counter() - t0 + self.start_seconds.get("checks", 0.0)
        logger.info(
            "session ready in %.1f s: %d ranks, engine %s, output %s (%s)",
            self.start_seconds["total"],
            cfg.launch.num_ranks,
            type(self.engine).__name__,
            self.output_dir,
            ", ".join(f"{k} {v:.2f} s" for k, v in self.start_seconds.items() if k != "total"),
        )

    def _restore(self, directory: Path, state: dict[str, Any], trainer: dict[str, Any]) -> None:
        """The controller's half of a resume: version ledger, data position, step and rollout counters."""
        ledger = VersionLedger.from_state_dict(state["ledger"])
        if trainer["version"] != ledger.trainer_version:
            raise VersionError(
                f"checkpoint {directory}: the ranks resumed at v{trainer['version']}, "
                f"its ledger.json records trainer v{ledger.trainer_version}"
            )
        self.versions = ledger
        self.prompt_sampler.load_state_dict(state["data"])
        counters = state["session"]
        if counters is None:
            # Checkpoints written before session.json: one rollout per step, as in the recipes' loop.
            logger.warning(
                "checkpoint %s has no session.json: assuming one rollout per step, so sampling seeds continue "
                "from %d (exact only for one rollout per update)",
                directory,
                ledger.trainer_version,
            )
            counters = {"step": ledger.trainer_version, "rollouts": ledger.trainer_version}
        self.step = int(counters["step"])
        self._rollouts = int(counters["rollouts"])
        self.resumed_from = directory
        set_log_context(version=ledger.trainer_version)
        logger.info(
            "resuming from %s: trainer v%d, step %d, %d rollouts sampled",
            directory,
            ledger.trainer_version,
            self.step,
            self._rollouts,
        )

    async def _start_engine(self) -> None:
        began = time.perf_counter()
        try:
            await self._start_engine_parts()
        finally:
            self.start_seconds["engine_load (overlapped)"] = time.perf_counter() - began

    async def _start_engine_parts(self) -> None:
        from transformers import AutoTokenizer

        from rlsdk.data import PromptSampler
        from rlsdk.data.prepare import build_prompt_dataset

        cfg = self.config
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(
                AutoTokenizer.from_pretrained, cfg.model.path, trust_remote_code=cfg.model.trust_remote_code
            )
        if self.special_tokens is None:
            self.special_tokens = await asyncio.to_thread(check_special_tokens, cfg, self.tokenizer)
        self.engine = await self._build_engine()
        self._engine_watch = asyncio.get_running_loop().create_task(self._watch_engine(self.engine))
        if self._restore_threads is None:
            import torch

            from rlsdk.engine.inference.embedded import single_thread_caller

            self._engine_threads = torch.get_num_threads()  # an engine built later (restart) keeps this default
            # This thread's tensor ops stay single-threaded while the Session runs, so no OpenMP worker of this
            # process spins on a core the ranks, the server or the engine's thread need (why:
            # single_thread_caller). Restored by close().
            self._restore_threads = single_thread_caller()
        params = SamplingParams(
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            stop=cfg.rollout.stop,
        )
        self.workflow = self._default_workflow = SingleTurnWorkflow(
            self.tokenizer, params, eos_token_ids=self.special_tokens.eos_token_ids
        )
        dataset = self._dataset
        if dataset is None:
            dataset = await asyncio.to_thread(build_prompt_dataset, cfg.data, seed=cfg.seed, tokenizer=self.tokenizer)
        self.prompt_sampler = PromptSampler(dataset, cfg.data.prompts_per_step, seed=cfg.seed)
        dir_mode, file_mode = output_modes(cfg.observe.output_mode)
        self.metrics = MetricsWriter(
            self.output_dir / "tensorboard", tensorboard=cfg.observe.tensorboard, dir_mode=dir_mode, file_mode=file_mode
        )

    async def _build_engine(self) -> SessionEngine:
        """The configured engine (see :func:`rlsdk.engine.inference.build_engine`)."""
        from rlsdk.engine.inference import EngineContext, build_engine

        context = EngineContext(
            config=self.config,
            special_tokens=self.special_tokens,
            trainer=_Ranks(self),
            launcher=self._launcher,
            runtime_dir=None if self._run.runtime_dir is None else self._run.runtime_dir.path,
            publish_dir=self._publish_dir,
            on_line=self._inference_line,
            num_threads=self._engine_threads,
        )
        return await build_engine(context)

    async def _watch_engine(self, engine: SessionEngine) -> None:
        """Turn an unexpected exit of the engine (its server) into an error for every later call (until restart)."""
        error = await engine.wait_failure()
        if self._closing or self.engine is not engine:
            return
        self._engine_failure = error
        logger.error("%s", self._engine_failure)

    async def restart_engine(self) -> WeightInfo:
        """Stop the inference engine (a dead vLLM server included), start a new one and sync the trainer's
        current weights to it, verified. Returns what the new engine serves.

        Raises ``InferenceServerError`` when the new server does not start, ``WeightMismatchError`` when it
        does not serve the trainer's version and checksum.
        """
        if self._closed:
            raise SessionClosedError("the session is closed; start a new one with Session.start(config)")
        old, self.engine = self.engine, None
        await cancel_quietly(self._engine_watch)
        self._engine_watch = None
        if old is not None:
            with contextlib.suppress(Exception):
                await old.close()
        self._engine_failure = None
        logger.info("restarting the inference engine%s", "" if old is None else f" ({type(old).__name__})")
        self.engine = await self._build_engine()
        self._engine_watch = asyncio.get_running_loop().create_task(self._watch_engine(self.engine))
        return await self.sync_weights()

    def _inference_line(self, line: str) -> None:
        level = next((name for name in ("ERROR", "WARNING", "CRITICAL") if f" {name} " in line), "INFO")
        self._run.route_child_line(
            line, role="inference", component="vllm", level=level, version=self.versions.engine_version
        )

    async def _after_run_failed(self) -> None:
        """After a fatal fault stopped the ranks (RunSupervisor.fail): stop what runs on top of them."""
        await self._stop_prefetch()
        await cancel_quietly(self._engine_watch)
        self._engine_watch = None
        if self.engine is not None:
            with contextlib.suppress(Exception):
                await self.engine.close()

    async def _broadcast(
        self, command: str, body: dict[str, Any] | list[dict[str, Any]] | None = None, *, timeout_s: float | None
    ) -> list[Any]:
        """A command to every rank (see :meth:`RunSupervisor.broadcast`: a fault fails the run)."""
        return await self._run.broadcast(command, body, timeout_s=timeout_s)

    def _engine(self) -> InferenceEngine:
        if self._failure is not None and not self._closed:
            raise SessionClosedError(
                f"the session's ranks failed: {self._failure}\n`await session.restart()` starts new processes and "
                "resumes from the last checkpoint (or `restart(resume_from=None)` from the start)."
            )
        if self._closed or self.engine is None:
            raise SessionClosedError("the session is closed; start a new one with Session.start(config)")
        if self._engine_failure is not None:
            raise self._engine_failure
        return self.engine

    async def close(self) -> None:
        """Stop the ranks and the engine, flush metrics and logs. Idempotent; nothing of the run stays alive."""
        if self._closed:
            return
        self._run.closing = True
        began = mark = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            self.close_seconds[name] = now - mark
            mark = now

        await self._stop_prefetch()
        lap("prefetch")
        await self._run.stop_ranks()
        lap("ranks_exit")
        await self._run.close_channel()
        await cancel_quietly(self._engine_watch)
        lap("channel")
        if self.engine is not None:
            await self.engine.close()
        lap("engine")
        if self._restore_threads is not None:
            self._restore_threads()
            self._restore_threads = None
        if self.metrics is not None:
            self.metrics.close()
        self._run.remove_dirs()
        logger.info("session closed")
        self._run.close_logs()
        lap("metrics_logs")
        self.close_seconds["total"] = time.perf_counter() - began
        self._closed = True

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ the four calls
    def next_prompts(self) -> list[dict[str, Any]]:
        """The next ``data.prompts_per_step`` rows of the session's data set (seeded, epoch-shuffled)."""
        self._engine()
        if self._lookahead is not None:  # drawn already, for the look-ahead (inference.lookahead)
            rows, self._lookahead = self._lookahead[0], None
            return rows
        return normalize_rows(self.prompt_sampler.next_batch())

    async def rollout(
        self, prompts: Sequence[Any] | dict[str, list[Any]] | None = None, *, progress: bool | None = None
    ) -> Rollout:
        """Sample ``rollout.group_size`` completions per prompt from the engine.

        ``prompts``: strings, dicts with a ``prompt`` key (other keys reach the reward function), a column
        batch from a ``datasets.Dataset``, or ``None`` for the next batch of the configured data set.
        ``progress``: a bar over the samples with the served version once the call outlasts a second (``None``:
        in Jupyter only).

        With ``rollout.mode='async'`` and ``prompts=None``, the batch was generated in the background since the
        previous call (while the ranks trained, so one version behind; a sync during it gives its later tokens
        the new version), and the next batch starts generating before this call returns. Explicit ``prompts``
        are always generated then and there.
        """
        engine = self._engine()
        if self.config.rollout.mode == "async" and prompts is None:
            if self._prefetch is None:
                self._start_prefetch(engine, progress=progress)
            assert self._prefetch is not None
            task, self._prefetch, self._prefetch_state = self._prefetch, None, None
            rollout = await task
            self._start_prefetch(engine, progress=False)
            return rollout
        rows = self.next_prompts() if prompts is None else normalize_rows(prompts)
        return await self._generate(engine, rows, progress=progress)

    def _start_prefetch(self, engine: InferenceEngine, *, progress: bool | None) -> None:
        """Start generating the next batch in the background (async mode). Remembers the data position and the
        rollout counter from before it, which a checkpoint records (the batch is regenerated on resume)."""
        self._prefetch_state = (self.prompt_sampler.state_dict(), self._rollouts)
        rows = self.next_prompts()
        self._prefetch = asyncio.get_running_loop().create_task(self._generate(engine, rows, progress=progress))

    async def _stop_prefetch(self) -> None:
        task, self._prefetch = self._prefetch, None
        await cancel_quietly(task)

    async def _generate(self, engine: InferenceEngine, rows: list[dict[str, Any]], *, progress: bool | None) -> Rollout:
        from rlsdk.observe.progress import CallProgress

        if not rows:
            raise ValueError("rollout needs at least one prompt; got an empty prompt list")
        assert self.workflow is not None
        start = time.perf_counter()
        seed = self._rollout_seed()
        self._rollouts += 1
        group_size = self.config.rollout.group_size
        trainer_version = self.versions.trainer_version
        with CallProgress(
            "rollout",
            total=len(rows) * group_size,
            unit="sample",
            postfix=lambda: f"engine v{self.versions.engine_version}",
            enabled=progress,
        ):
            rollout = await self.workflow.arun_batch(engine, rows, group_size, seed=seed)
        rollout.info["seconds"] = time.perf_counter() - start
        rollout.info["trainer_version"] = trainer_version
        return rollout

    def _rollout_seed(self) -> int:
        """The next rollout's seed: one per rollout, derived from the session seed, so the same config replays
        the same samples."""
        return (self.config.seed * 1_000_003 + self._rollouts) % (1 << 62)

    def _next_request(self) -> tuple[list[list[int]], SamplingParams] | None:
        """The prompts and params the next default ``rollout()`` will ask the engine for (the data set's next rows,
        drawn now and kept for it, and the next seed), for an engine that samples them right after an update
        (the colocated engine's ``inference.lookahead``); ``None`` when they are not known yet (async mode, a
        custom workflow, no data left)."""
        if self.config.rollout.mode != "sequential" or type(self.workflow) is not SingleTurnWorkflow:
            return None
        if self._lookahead is None:
            before = self.prompt_sampler.state_dict()
            try:
                rows = normalize_rows(self.prompt_sampler.next_batch())
            except Exception:  # the next rollout() raises it where the user asked for the rows
                logger.debug("no look-ahead: drawing the next rows failed", exc_info=True)
                self.prompt_sampler.load_state_dict(before)
                return None
            self._lookahead = (rows, before)
        try:
            _, repeated, params = self.workflow.request(
                self._lookahead[0], self.config.rollout.group_size, seed=self._rollout_seed()
            )
        except Exception:  # e.g. an empty prompt: the rollout() that takes these rows raises it
            logger.debug("no look-ahead: the next batch's request is invalid", exc_info=True)
            return None
        return repeated, params

    async def reward(self, rollout: Rollout, reward_fn: RewardFn, *, timeout_s: float | None = None) -> Rollout:
        """Score ``rollout`` with ``reward_fn`` (sync or async, batched); returns a new Rollout with rewards.

        A function that also reports components (:func:`rlsdk.rewards.combine_rewards`) leaves them on the new
        rollout as ``info["reward_components"]``: name -> unweighted values, float32 ``(B,)``.

        Raises ``RewardError`` naming the function when it raises, times out, or returns the wrong number of
        values or a non-finite value; the input rollout is left untouched.
        """
        engine = self._engine()
        rewarded = await self._reward(rollout, reward_fn, timeout_s)
        if not self.config.rollout.dynamic_sampling:
            return rewarded
        return await self._fill_informative(engine, rewarded, reward_fn, timeout_s)

    async def _reward(self, rollout: Rollout, reward_fn: RewardFn, timeout_s: float | None) -> Rollout:
        start = time.perf_counter()
        rewards_B, components = await compute_reward_breakdown(rollout, reward_fn, timeout_s=timeout_s)
        info = {**rollout.info, "reward_seconds": time.perf_counter() - start}
        if components:
            info["reward_components"] = components
        return dataclasses.replace(rollout, rewards_B=rewards_B, info=info)

    async def _fill_informative(
        self, engine: InferenceEngine, rewarded: Rollout, reward_fn: RewardFn, timeout_s: float | None
    ) -> Rollout:
        """DAPO's dynamic sampling (``rollout.dynamic_sampling``): keep the groups whose rewards differ, and
        generate and reward groups of new prompts (the next data-set rows; the rest of each refill batch is
        skipped) until the batch is full again or ``rollout.max_sampling_rounds`` rounds ran."""
        from rlsdk.workflow.dynamic_sampling import fill_informative_groups

        first: list[Rollout] = [rewarded]

        async def sample(groups: int) -> Rollout:
            if first:
                return first.pop()
            rows = self.next_prompts()[:groups]
            return await self._reward(await self._generate(engine, rows, progress=False), reward_fn, timeout_s)

        rollout, stats = await fill_informative_groups(
            sample,
            len(rewarded.rows),
            max_rounds=self.config.rollout.max_sampling_rounds,
            pad_token_id=self.special_tokens.pad_token_id,
        )
        parts = rollout.info.get("parts") or [rewarded.info]
        rollout.info["seconds"] = sum(float(part.get("seconds", 0.0)) for part in parts)
        rollout.info["trainer_version"] = rewarded.info.get("trainer_version")
        rollout.info["dynamic_sampling"] = stats
        return rollout

    async def update(self, rollout: Rollout, *, progress: bool | None = None) -> dict[str, float]:
        """Train on ``rollout`` (``train.ppo_epochs`` x mini-batches optimizer steps on every rank); the trainer
        publishes version + 1 (one version per update, however many optimizer steps).

        Samples staler than ``rollout.max_staleness`` raise ``StaleRolloutError`` (policy ``raise``) or are
        dropped and counted (policy ``drop``). Returns step metrics (means over completion tokens).
        ``progress``: a bar over the ranks' micro-batches (from their heartbeats) with the batch's reward and the
        versions, once the call outlasts a second (``None``: in Jupyter only).
        """
        from rlsdk.algorithms import compute_advantages
        from rlsdk.algorithms.batching import shard_rows, trainable_indices, update_tensors
        from rlsdk.engine.train.schedule import minibatch_normalisers
        from rlsdk.observe.progress import CallProgress

        engine = self._engine()
        cfg = self.config
        engine.before_train()
        if rollout.rewards_B is None:
            raise ValueError("rollout has no rewards: call `rollout = await session.reward(rollout, fn)` first")
        start = time.perf_counter()
        world = cfg.launch.num_ranks
        keep_B = staleness_mask(
            rollout.behaviour_versions_B,
            self.versions.trainer_version,
            cfg.rollout.max_staleness,
            cfg.rollout.stale_policy,
        )
        # Over the whole rollout, stale samples included: the group and batch statistics see every sample.
        # (DAPO's dynamic sampling already ran in reward(), see rollout.dynamic_sampling.)
        advantages_B = compute_advantages(
            rollout.rewards_B,
            rollout.group_size,
            cfg.algorithm.resolved().advantage or "grpo",
            scale_by_std=cfg.algorithm.scale_rewards,
            eps=cfg.algorithm.adv_eps,
        )
        index_B, stale = trainable_indices(keep_B, world)
        if index_B.numel() == 0:
            raise VersionError(
                f"no sample left to train on: {stale} stale samples dropped and {world} ranks need at least one "
                f"sample each (trainer v{self.versions.trainer_version}, max_staleness {cfg.rollout.max_staleness})"
            )
        self.versions.dropped_stale_samples += stale
        batch = update_tensors(rollout, advantages_B, index_B)
        # Trainer and engine are compared only on rows the trainer's own weights sampled wholly (agreement/*).
        batch["agreement_mask_B_C"] = current_rows_B_C(rollout, self.versions.trainer_version)[index_B]
        shared = {
            "num_tokens": int(batch["completion_mask_B_C"].sum()),
            "num_sequences": index_B.numel(),
            "minibatches": minibatch_normalisers(batch["completion_mask_B_C"], world, cfg.train.mini_batch_size),
        }
        fields = engine.train_fields(world, self._next_request)
        bodies = [{"shard": shard, **shared, **fields[r]} for r, shard in enumerate(shard_rows(batch, world))]
        trainer_version = self.versions.trainer_version
        reward_mean = float(rollout.rewards_B.mean())
        with CallProgress(
            "update",
            unit="micro-batch",
            poll=self._update_progress,
            postfix=lambda: f"reward {reward_mean:.3f}, trainer v{trainer_version} -> v{trainer_version + 1}",
            enabled=progress,
        ):
            results = await self._broadcast("update", bodies, timeout_s=cfg.launch.command_timeout_s)
        self._record_trainer_version("update", results, engine)
        stats = self._update_stats(rollout, results, stale=stale, used=index_B.numel(), began=start)
        if self.metrics is not None:
            self.metrics.log(self.step, stats)
            self.metrics.log_text(self.step, "samples", samples_markdown(rollout))
        self._warn_after_update(stats, rollout, advantages_B[index_B])
        if stale:
            logger.info(
                "update %d: used %d samples, dropped %d stale (trainer v%d, max_staleness %d)",
                self.step,
                index_B.numel(),
                stale,
                self.versions.trainer_version - 1,
                cfg.rollout.max_staleness,
            )
        logger.debug("update %d: %s", self.step, stats)
        return stats

    def _update_stats(
        self, rollout: Rollout, results: list[dict[str, Any]], *, stale: int, used: int, began: float
    ) -> dict[str, float]:
        """An update's metrics: the rollout's rewards and completions, the ranks' ``train/*`` and ``agreement/*``
        (:func:`~rlsdk.observe.rollout_metrics.update_metrics`), timings, throughput and versions."""
        from rlsdk.observe.rollout_metrics import update_metrics

        update_s = time.perf_counter() - began
        rollout_s = float(rollout.info.get("seconds", float("nan")))
        ranks = update_metrics(results, world=self.config.launch.num_ranks)
        return {
            "step": float(self.step),
            **reward_metrics(rollout),  # mean, std and each combine_rewards() component
            **ranks,
            "train/dropped_stale": float(stale),
            "train/used_samples": float(used),
            "time/update_s": update_s,
            "time/rollout_s": rollout_s,
            "time/reward_s": float(rollout.info.get("reward_seconds", float("nan"))),
            **completion_metrics(
                rollout,
                max_new_tokens=self.config.rollout.max_new_tokens,
                eos_token_ids=self.special_tokens.eos_token_ids,
            ),
            **throughput_metrics(
                rollout_tokens=float(rollout.completion_mask_B_C.sum()),
                rollout_s=rollout_s,
                update_tokens=ranks["train/tokens"],
                update_s=update_s,
            ),
            "version/trainer": float(self.versions.trainer_version),
            "version/engine": float(self.versions.engine_version),
            "version/behaviour_min": float(rollout.behaviour_versions_B.min()),
            **{k: float(v) for k, v in rollout.info.get("dynamic_sampling", {}).items()},
        }

    def _warn_after_update(self, stats: dict[str, float], rollout: Rollout, advantages_B: Any) -> None:
        """The update's warnings (see :mod:`rlsdk.observe.update_checks`): the entropy bonus once, at the first
        update with a signal; the trainer/engine disagreement at every update past the threshold."""
        from rlsdk.observe.update_checks import check_entropy_bonus, warn_on_disagreement

        cfg = self.config
        if not self._entropy_checked:
            vocab = len(self.tokenizer) if self.tokenizer is not None else 0
            self._entropy_checked = check_entropy_bonus(
                cfg.algorithm.entropy_coef, stats["train/entropy"], advantages_B, vocab=vocab, step=self.step
            )
        warn_on_disagreement(
            stats,
            step=self.step,
            threshold=cfg.inference.logprob_warn_threshold,
            compared_version=self.versions.trainer_version - 1,  # the weights the update started from
            served_dtype=cfg.inference.dtype or cfg.model.dtype,
            trained_dtype="bf16 (float32 master weights)" if cfg.train.mixed_precision == "bf16" else cfg.model.dtype,
        )

    def _record_trainer_version(self, command: str, results: list[dict[str, Any]], engine: SessionEngine) -> None:
        """After an optimizer step on every rank (``update``, ``sft_update``): the ranks' one new version becomes the
        trainer's, and ``session.step`` advances; the engine sees the results (its ``after_train`` hook).
        Raises ``VersionError`` when the ranks disagree."""
        versions = {int(r["version"]) for r in results}
        if len(versions) != 1:
            raise VersionError(f"ranks disagree on the trainer version after {command}: {sorted(versions)}")
        engine.after_train(results, _Ranks(self))
        self.versions.trainer_version = versions.pop()
        set_log_context(version=self.versions.trainer_version)
        self.step += 1

    def _update_progress(self) -> tuple[int, int] | None:
        """Micro-batches done / total, summed over the ranks whose heartbeat reports the running update."""
        return self._run.command_progress("update")

    async def sync_weights(self) -> WeightInfo:
        """Publish the trainer's weights to the engine; verify it serves the trainer's version and checksum.

        Raises ``WeightMismatchError`` naming both versions/checksums when the engine does not serve exactly
        what the trainer published.
        """
        engine = self._engine()
        start = time.perf_counter()
        info = await engine.sync(_Ranks(self), self.versions.trainer_version)
        seconds = time.perf_counter() - start
        self.versions.trainer_checksum = info.checksum
        self.versions.record_sync(info.version, info.checksum, seconds)
        if self.metrics is not None:
            sync_stats = {"time/sync_s": seconds, "version/engine": float(info.version)}
            if info.bytes is not None:  # what the sync moved (a LoRA run: the adapter only)
                sync_stats["sync/bytes"] = float(info.bytes)
            self.metrics.log(self.step, sync_stats)
        logger.debug("engine now serves v%d (sync %.3f s)", info.version, seconds)
        return info

    # ------------------------------------------------------------------ supervised fine-tuning
    async def sft_update(self, batch: Any, *, lr: float | None = None) -> dict[str, float]:
        """One supervised fine-tuning step on every rank; the trainer publishes version + 1, as :meth:`update`
        does, and :meth:`sync_weights` then brings the engine to the SFT'd weights, verified as any sync.

        ``batch``: the tensors of :func:`rlsdk.data.sft.collate_sft` (``SFTBatches.next_batch()``:
        ``prompt_ids_B_P``, ``prompt_mask_B_P``, ``completion_ids_B_C``, ``completion_mask_B_C``), or rows with
        ``prompt`` and ``completion`` (text, or chat messages put through the tokenizer's chat template; see
        :mod:`rlsdk.data.sft`). The loss is the token mean of the completion tokens' negative log-likelihood over
        the whole batch (prompt tokens are never targets). Its rows are split evenly over the ranks, so their
        count must be a multiple of ``launch.num_ranks``. ``lr``: the learning rate of this step only (an SFT
        schedule: warm-up, decay), None = ``train.lr``. Returns ``sft/loss``, ``sft/perplexity``,
        ``sft/tokens``, ``sft/sequences``, ``sft/grad_norm``, ``sft/lr``, ``time/sft_s``,
        ``throughput/sft_tokens_per_s`` and the versions, logged to TensorBoard at the new ``session.step``.

        Raises:
            ValueError: a malformed batch (see :func:`rlsdk.data.sft.check_sft_batch` and
                :func:`~rlsdk.data.sft.tokenize_sft`), a row count that is not a positive multiple of the
                rank count (nothing is dropped), or an ``lr`` that is not > 0.
        """
        from rlsdk.algorithms.batching import shard_rows
        from rlsdk.data.sft import check_sft_batch, collate_sft, tokenize_sft
        from rlsdk.observe.rollout_metrics import sft_metrics

        engine = self._engine()
        cfg = self.config
        if isinstance(batch, (list, tuple)):
            examples = tokenize_sft(batch, self.tokenizer, eos_token_ids=self.special_tokens.eos_token_ids)
            batch = collate_sft(examples, self.special_tokens.pad_token_id)
        if lr is not None and not (isinstance(lr, (int, float)) and lr > 0 and lr != float("inf")):
            raise ValueError(f"lr={lr!r} is invalid: allowed None or a finite float > 0")
        tensors = check_sft_batch(batch)
        world = cfg.launch.num_ranks
        rows = tensors["completion_ids_B_C"].shape[0]
        if rows % world:
            raise ValueError(
                f"an SFT batch of {rows} rows cannot be split evenly over launch.num_ranks={world} ranks: use a "
                f"multiple of {world} (every rank runs the same number of forward/backward passes)"
            )
        engine.before_train()
        num_tokens = int(tensors["completion_mask_B_C"].sum())
        fields = engine.train_fields(world, lambda: None)
        bodies = [
            {"shard": shard, "num_tokens": num_tokens, "lr": None if lr is None else float(lr), **fields[r]}
            for r, shard in enumerate(shard_rows(tensors, world))
        ]
        start = time.perf_counter()
        results = await self._broadcast("sft_update", bodies, timeout_s=cfg.launch.command_timeout_s)
        self._record_trainer_version("sft_update", results, engine)
        stats = {
            "step": float(self.step),
            **sft_metrics(results, seconds=time.perf_counter() - start),
            "version/trainer": float(self.versions.trainer_version),
            "version/engine": float(self.versions.engine_version),
        }
        if self.metrics is not None:
            self.metrics.log(self.step, stats)
        logger.debug("sft step %d: %s", self.step, stats)
        return stats

    # ------------------------------------------------------------------ the library loop and evaluation
    async def train(self, reward_fn: RewardFn, **kwargs: Any) -> Any:
        """Run the RL loop (rollout -> reward -> update -> sync per step) with ``reward_fn``, honouring
        ``train.max_steps``, ``train.checkpoint_every``, ``train.eval_every`` and ``train.target_reward`` unless
        the keyword arguments override them (``steps``, ``checkpoint_every``, ``eval_every``, ``eval_prompts``,
        ``eval_samples``, ``target_reward``, ``target_metric``, ``progress``, ``on_step``); returns a
        :class:`~rlsdk.train_loop.TrainSummary`. See :func:`rlsdk.train_loop.train`. The four single-step calls
        stay for interactive use."""
        from rlsdk.train_loop import train

        return await train(self, reward_fn, **kwargs)

    async def evaluate(
        self,
        prompts: Sequence[Any] | dict[str, list[Any]] | None,
        reward_fn: RewardFn,
        *,
        n: int = 1,
        greedy: bool = True,
        num_prompts: int | None = None,
        pass_threshold: float = 1.0,
        timeout_s: float | None = None,
        prefix: str = "eval",
    ) -> dict[str, float]:
        """Score the policy the engine serves now on held-out prompts; log and return ``eval/*`` metrics.

        ``prompts``: strings, dicts with a ``prompt`` key, a ``datasets.Dataset`` or column batch; ``None``: the
        rows of ``data.eval_path`` (all, or the first ``num_prompts``), else ``num_prompts`` (default 64) freshly
        seeded rows of the configured generated task (see :func:`rlsdk.evaluation.held_out_prompts`). ``n``
        samples per prompt; ``greedy``: temperature 0 with the session's workflow (then ``n`` must be 1), else its
        training sampling settings. Returns
        ``eval/reward_mean``, ``eval/reward_std``, ``eval/pass@1`` (samples whose reward >= ``pass_threshold``),
        ``eval/pass@n`` (n > 1), the ``eval/completion/*`` lengths and rates, ``eval/num_prompts``,
        ``eval/engine_version`` and ``eval/seconds``; logged to TensorBoard at the current step, with sample
        completions under ``eval/samples``. ``prefix`` replaces ``eval`` in every name (e.g. ``eval_sampled``, to
        log a sampled evaluation beside the greedy one at the same step). The training data position and rollout
        seeds are untouched.

        Raises ``ValueError`` for ``n < 1``, ``greedy`` with ``n > 1``, no prompts, an empty ``prefix``, or
        ``prompts=None`` with ``data.task='file'`` and no ``data.eval_path``; ``RewardError`` as :meth:`reward`.
        """
        from rlsdk.evaluation import check_eval_args, eval_metrics, eval_seed, eval_workflow, held_out_prompts

        engine = self._engine()
        check_eval_args(n, greedy, prefix)
        if prompts is None:
            rows = self._held_out.get(num_prompts)
            if rows is None:  # the same held-out rows at every evaluation of this session
                rows = await asyncio.to_thread(held_out_prompts, self.config, self.tokenizer, num_prompts)
                self._held_out[num_prompts] = rows
        else:
            rows = normalize_rows(prompts)
        if not rows:
            raise ValueError("evaluate needs at least one prompt; got an empty prompt list")
        assert self.workflow is not None
        workflow = eval_workflow(self.workflow, greedy=greedy)
        start = time.perf_counter()
        rollout = await workflow.arun_batch(engine, rows, n, seed=eval_seed(self.config, self.step))
        rollout = await self._reward(rollout, reward_fn, timeout_s)
        metrics = eval_metrics(
            rollout,
            n=n,
            pass_threshold=pass_threshold,
            max_new_tokens=getattr(getattr(workflow, "params", None), "max_new_tokens", 0) or 1 << 30,
            eos_token_ids=self.special_tokens.eos_token_ids,
            engine_version=self.versions.engine_version,
            seconds=time.perf_counter() - start,
            prefix=prefix,
        )
        if self.metrics is not None:
            self.metrics.log(self.step, metrics)
            self.metrics.log_text(self.step, f"{prefix}/samples", samples_markdown(rollout))
        logger.info(
            "evaluation at step %d (engine v%d, %d prompts x %d, %s): reward %.3f, pass@1 %.3f",
            self.step,
            int(metrics[f"{prefix}/engine_version"]),
            len(rows),
            n,
            "greedy" if greedy else "sampled",
            metrics[f"{prefix}/reward_mean"],
            metrics[f"{prefix}/pass@1"],
        )
        return metrics

    # ------------------------------------------------------------------ checkpoints and low-level calls
    async def save_checkpoint(self) -> Path:
        """Write ``OUTPUT/checkpoints/step_N`` atomically (N = trainer version); keeps ``train.keep_checkpoints``.

        A new Session continues from it exactly with ``train.resume_from`` (the path, or 'latest')."""
        import json

        import yaml

        from rlsdk.engine.train.checkpoint import finalize_checkpoint, prune_checkpoints

        self._engine()
        dir_mode, file_mode = output_modes(self.config.observe.output_mode)
        root = private_dir(self.output_dir / "checkpoints", mode=dir_mode)
        version = self.versions.trainer_version
        # A batch generating in the background (async mode) is not part of the run yet: record the data position
        # and rollout count from before it, so a resume generates it again (from the checkpoint's weights).
        if self._prefetch_state is not None:
            data_state, rollouts = self._prefetch_state
        elif self._lookahead is not None:  # rows drawn for the look-ahead, not yet rolled out
            data_state, rollouts = self._lookahead[1], self._rollouts
        else:
            data_state, rollouts = self.prompt_sampler.state_dict(), self._rollouts
        tmp = root / f"step_{version}.tmp-{uuid.uuid4().hex[:8]}"
        await self._broadcast(
            "save_checkpoint", {"directory": str(tmp)}, timeout_s=self.config.launch.command_timeout_s
        )
        await asyncio.to_thread(self.tokenizer.save_pretrained, str(tmp / "model"))
        extra = {
            "ledger.json": json.dumps(self.versions.state_dict(), indent=1),
            "config.yaml": yaml.safe_dump(config_to_dict(self.config), sort_keys=False),
            "data_state.json": json.dumps(data_state),
            "session.json": json.dumps({"step": self.step, "rollouts": rollouts}),
        }
        final = await asyncio.to_thread(finalize_checkpoint, tmp, root / f"step_{version}", extra)
        await asyncio.to_thread(restrict_tree, final, dir_mode, file_mode)  # e.g. the tokenizer's files
        await asyncio.to_thread(prune_checkpoints, root, self.config.train.keep_checkpoints)
        logger.info("checkpoint written: %s", final)
        return final

    async def call(self, command: str, body: dict[str, Any] | list[dict[str, Any]] | None = None) -> list[Any]:
        """Send a raw command to every rank and gather the results (index = rank). ``noop`` measures latency."""
        self._engine()
        return await self._broadcast(command, body, timeout_s=self.config.launch.command_timeout_s)

    async def trace(self, *, timeout_s: float = 2.0) -> Any:
        """Every rank's collective trace and thread stacks, compared now: a ``TraceReport`` (``print`` it, or
        show it in a notebook). Works while a command is stuck. Needs ``launch.tracer`` (else: stacks only)."""
        if self._channel is None or self._closed:
            raise SessionClosedError("the session is closed; start a new one with Session.start(config)")
        return await self._run.trace(timeout_s)

    def _record_trace(self, report: Any) -> None:
        self.last_trace = report
        self.last_trace_time = time.time()

    @property
    def hung_command(self) -> Any:
        """The command the hang watchdog reported (a :class:`~rlsdk.debug.watchdog.HungCommand`: ``command``,
        ``report``, ``path``, ``seconds``) while it is still pending on the ranks; ``None`` otherwise."""
        return self._run.hung_command()

    async def keep_waiting(self, timeout_s: float | None = None) -> list[Any]:
        """After a ``CollectiveHangError``: wait on the hung command (still watched), instead of terminating the
        ranks with :meth:`close`. Returns the command's raw results (index = rank) if the ranks get out.

        Raises ``RuntimeError`` when no command is hung, ``TimeoutError`` after ``timeout_s`` (the command stays
        pending: call again or close), ``CollectiveHangError`` again while the divergence persists (per
        ``launch.hang_policy``), and the ranks' own error (e.g. the process-group timeout) if the command fails.
        """
        if self._channel is None or self._closed:
            raise SessionClosedError("the session is closed; start a new one with Session.start(config)")
        return await self._run.keep_waiting(timeout_s)

    def status(self) -> dict[str, Any]:
        """Ranks (pid, heartbeat age, current command and its ``(done, total)`` progress, alive), versions, the
        last batch's staleness verdict (``last_batch``: see :func:`rlsdk.observe.status.last_batch_staleness`),
        the latest collective trace's headline (``trace``) and a command the watchdog reported hung (``hung``),
        for humans and dashboards."""
        from rlsdk.observe.status import hung_summary, trace_summary

        return {
            "closed": self._closed,
            "failure": None if self._failure is None else str(self._failure).splitlines()[0],
            "ranks": self._run.rank_status(running=not self._closed),
            "trainer_version": self.versions.trainer_version,
            "engine_version": self.versions.engine_version,
            "in_sync": self.versions.in_sync,
            "step": self.step,
            "trace": trace_summary(self.last_trace, self.last_trace_time),
            "hung": hung_summary(self.hung_command),
            "last_batch": last_batch_staleness(
                self.metrics.history if self.metrics is not None else (), self.config.rollout.max_staleness
            ),
        }

    def status_text(self) -> str:
        """:meth:`status` and the latest metrics as a few plain-text lines (the terminal's dashboard)."""
        from rlsdk.observe.status import format_status_text

        return format_status_text(self.status(), self.metrics.history if self.metrics is not None else ())

    def dashboard(self, *, mode: str = "auto", interval_s: float | None = None) -> Any:
        """A live dashboard: ranks, versions, metric plots and filterable rank logs, refreshing while cells await.

        In Jupyter (``mode='auto'``) an ipywidgets view (needs the ``notebook`` extra); elsewhere, or with
        ``mode='text'``, :meth:`status_text` logged every ``interval_s``. See :mod:`rlsdk.observe.dashboard`.
        """
        from rlsdk.observe.dashboard import open_dashboard

        return open_dashboard(self, mode=mode, interval_s=interval_s)  # type: ignore[arg-type]  # checked there
