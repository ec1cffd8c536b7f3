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

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlsdk import session_parts as parts
from rlsdk.config import SessionConfig, config_to_dict
from rlsdk.engine.inference.protocol import InferenceEngine, SessionEngine, WeightInfo
from rlsdk.observe.logging import RankLogRouter, capture_records, get_logger, set_log_context
from rlsdk.observe.metrics import MetricsWriter
from rlsdk.observe.rollout_metrics import samples_markdown
from rlsdk.observe.update_stats import sync_metrics
from rlsdk.preflight import check_before_start
from rlsdk.preflight import check_data as check_data  # re-exported: imported from here before rlsdk.preflight
from rlsdk.preflight import check_model_dir as check_model_dir
from rlsdk.preflight import check_model_files as check_model_files
from rlsdk.preflight import load_resume_state as load_resume_state
from rlsdk.rewards.apply import RewardFn
from rlsdk.session_checkpoint import restore_controller_state
from rlsdk.session_engine import EngineSlot
from rlsdk.supervisor import RunSupervisor, TrainerRanks
from rlsdk.supervisor import rank_startup_seconds as rank_startup_seconds  # re-exported: it lived here
from rlsdk.versioning import VersionError, VersionLedger
from rlsdk.workflow.driver import RolloutDriver, reward_rollout
from rlsdk.workflow.rollout import Rollout, normalize_rows
from rlsdk.workflow.single_turn import RolloutWorkflow

logger = get_logger("rlsdk.session")


class SessionClosedError(RuntimeError):
    """The Session was closed (or failed to start); start a new one."""


async def _prepare_train(engine: Any) -> None:
    """Await the engine's optional ``prepare_train`` hook (see ``SessionEngine.before_train``): engines written
    before it need not define it."""
    prepare = getattr(engine, "prepare_train", None)
    if prepare is not None:
        await prepare()


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
        # The rollout half: prompts drawn, seeds, the batch generating in the background (rlsdk.workflow.driver).
        self._sampling = RolloutDriver(self)
        self._engines = self._new_engines()  # the engine, watched for an unexpected exit (rlsdk.session_engine)
        self._resume: tuple[Path, dict[str, Any]] | None = None  # (checkpoint, controller state), see start()
        self.resumed_from: Path | None = None  # the checkpoint this session continued from
        self._closed = False
        self._phase: Any = lambda _phase: None  # progress hook of start(); see rlsdk.observe.progress
        self.last_trace: Any = None  # the latest TraceReport (watchdog or trace()); the dashboard's tracer view
        self.last_trace_time: float | None = None  # time.time() of last_trace
        self._early_records: list[logging.LogRecord] = []  # see start(): shown once logging is set up
        self._entropy_checked = False  # see rlsdk.observe.update_checks.warn_after_update
        self._held_out: dict[int | None, list[dict[str, Any]]] = {}  # evaluate(None, ...)'s rows by num_prompts
        # Seconds each part of start() and close() took (see rank_startup_seconds): the start bar's phases, the
        # ranks' own start-up, the overlapped engine load; benchmarks/session_overhead.py reports them.
        self.start_seconds: dict[str, float] = {}
        self.close_seconds: dict[str, float] = {}

    def _new_run(self) -> RunSupervisor:
        return RunSupervisor(
            self.config, self.output_dir, on_failure=self._after_run_failed, on_trace=self._record_trace
        )

    def _new_engines(self) -> EngineSlot:
        return EngineSlot(self._build_engine, closing=lambda: self._run.closing)

    @property
    def engine(self) -> SessionEngine | None:
        """The inference engine the rollouts sample from (``None`` before start)."""
        return self._engines.engine

    @engine.setter
    def engine(self, engine: SessionEngine | None) -> None:
        self._engines.engine = engine

    @property
    def log_router(self) -> RankLogRouter | None:
        """The run's log router (rank, server and controller records; ``add_listener`` for a live view)."""
        return self._run.router

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` finished (after it, every call raises ``SessionClosedError``)."""
        return self._closed

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
            "" if self._run.failure is None else f" after: {str(self._run.failure).splitlines()[0]}",
        )
        listeners = self.log_router.listeners() if self.log_router is not None else []  # e.g. a dashboard's
        await self.close()
        fresh = type(self)(config)
        self.__dict__.update(fresh.__dict__)  # keep this object (and whoever holds it), with a new start's state
        self._run = self._new_run()  # its hooks call this object, not `fresh`
        self._engines, self._sampling = self._new_engines(), RolloutDriver(self)  # as do these
        self._early_records = early
        await self._start_checked(checked, progress=progress, desc="Session.restart")
        for listener in listeners:
            self.log_router.add_listener(listener)
        if workflow is not None:
            self.workflow = workflow
        return self.resumed_from

    async def _start(self) -> None:
        cfg = self.config
        t0 = time.perf_counter()
        init: dict[str, Any] = {"config": config_to_dict(cfg)}
        if self._resume is not None:
            init["resume_from"] = str(self._resume[0])
        early, self._early_records = self._early_records, []
        # The engine loads while the ranks import torch and form their process group.
        results = await self._run.start_ranks(
            early, init, alongside=self._start_engine, phase=self._phase, seconds=self.start_seconds
        )
        self.rank_info = self._run.rank_info
        trainer = results[0]
        self._phase("verifying weights")
        if self._resume is not None:
            directory, state = self._resume
            restored = restore_controller_state(directory, state, trainer, self.prompt_sampler)
            self.versions, self.step, self._sampling.rollouts = restored
            self.resumed_from = directory
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

    async def _start_engine(self) -> None:
        cfg, began = self.config, time.perf_counter()
        try:
            self.tokenizer, self.special_tokens = await parts.load_tokenizer(cfg, self.tokenizer, self.special_tokens)
            await self._engines.attach()
            self._engines.pin_threads()  # restored by close()
            self.workflow = self._default_workflow = parts.default_workflow(cfg, self.tokenizer, self.special_tokens)
            self.prompt_sampler = await parts.prompt_sampler(cfg, self._dataset, self.tokenizer)
            self.metrics = parts.metrics_writer(cfg, self.output_dir)
        finally:
            self.start_seconds["engine_load (overlapped)"] = time.perf_counter() - began

    async def _build_engine(self) -> SessionEngine:
        """The configured engine (see :func:`rlsdk.engine.inference.build_engine`)."""
        from rlsdk.engine.inference import build_engine

        context = self._run.engine_context(
            self.special_tokens, lambda: self.versions.engine_version, self._engines.num_threads
        )
        return await build_engine(context)

    async def restart_engine(self) -> WeightInfo:
        """Stop the inference engine (a dead vLLM server included), start a new one and sync the trainer's
        current weights to it, verified. Returns what the new engine serves.

        Raises ``InferenceServerError`` when the new server does not start, ``WeightMismatchError`` when it
        does not serve the trainer's version and checksum.
        """
        if self._closed:
            raise SessionClosedError("the session is closed; start a new one with Session.start(config)")
        await self._engines.replace()
        return await self.sync_weights()

    async def _after_run_failed(self) -> None:
        """After a fatal fault stopped the ranks (RunSupervisor.fail): stop what runs on top of them."""
        await self._sampling.stop_prefetch()
        await self._engines.stop()

    async def _broadcast(
        self, command: str, body: dict[str, Any] | list[dict[str, Any]] | None = None, *, timeout_s: float | None
    ) -> list[Any]:
        """A command to every rank (see :meth:`RunSupervisor.broadcast`: a fault fails the run)."""
        return await self._run.broadcast(command, body, timeout_s=timeout_s)

    def _engine(self) -> InferenceEngine:
        if self._run.failure is not None and not self._closed:
            raise SessionClosedError(
                f"the session's ranks failed: {self._run.failure}\n`await session.restart()` starts new processes and "
                "resumes from the last checkpoint (or `restart(resume_from=None)` from the start)."
            )
        if self._closed or self.engine is None:
            raise SessionClosedError("the session is closed; start a new one with Session.start(config)")
        if self._engines.failure is not None:
            raise self._engines.failure
        return self.engine

    async def close(self) -> None:
        """Stop the ranks and the engine, flush metrics and logs. Idempotent; nothing of the run stays alive."""
        if self._closed:
            return
        from rlsdk.observe.progress import Laps

        self._run.closing = True
        lap = Laps(self.close_seconds)
        await self._sampling.stop_prefetch()
        lap("prefetch")
        await self._run.stop_ranks()
        lap("ranks_exit")
        await self._run.close_channel()
        await self._engines.unwatch()
        lap("channel")
        if self.engine is not None:
            await self.engine.close()
        lap("engine")
        self._engines.restore_threads()
        if self.metrics is not None:
            self.metrics.close()
        self._run.remove_dirs()
        logger.info("session closed")
        self._run.close_logs()
        lap("metrics_logs")
        lap.total()
        self._closed = True

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ the four calls
    def next_prompts(self) -> list[dict[str, Any]]:
        """The next ``data.prompts_per_step`` rows of the session's data set (seeded, epoch-shuffled)."""
        self._engine()
        return self._sampling.next_prompts()

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
        if prompts is None:
            return await self._sampling.next_batch(engine, progress=progress)
        return await self._sampling.generate(engine, normalize_rows(prompts), progress=progress)

    async def reward(self, rollout: Rollout, reward_fn: RewardFn, *, timeout_s: float | None = None) -> Rollout:
        """Score ``rollout`` with ``reward_fn`` (sync or async, batched); returns a new Rollout with rewards.

        A function that also reports components (:func:`rlsdk.rewards.combine_rewards`) leaves them on the new
        rollout as ``info["reward_components"]``: name -> unweighted values, float32 ``(B,)``.

        Raises ``RewardError`` naming the function when it raises, times out, or returns the wrong number of
        values or a non-finite value; the input rollout is left untouched.
        """
        engine = self._engine()
        rewarded = await reward_rollout(rollout, reward_fn, timeout_s)
        if not self.config.rollout.dynamic_sampling:
            return rewarded
        return await self._sampling.fill_informative(engine, rewarded, reward_fn, timeout_s)

    async def update(self, rollout: Rollout, *, progress: bool | None = None) -> dict[str, float]:
        """Train on ``rollout`` (``train.ppo_epochs`` x mini-batches optimizer steps on every rank); the trainer
        publishes version + 1 (one version per update, however many optimizer steps).

        Samples staler than ``rollout.max_staleness`` raise ``StaleRolloutError`` (policy ``raise``) or are
        dropped and counted (policy ``drop``). Returns step metrics (means over completion tokens).
        ``progress``: a bar over the ranks' micro-batches (from their heartbeats) with the batch's reward and the
        versions, once the call outlasts a second (``None``: in Jupyter only).
        """
        from rlsdk.observe.progress import CallProgress
        from rlsdk.observe.update_checks import warn_after_update
        from rlsdk.observe.update_stats import update_step_metrics
        from rlsdk.train_batches import prepare_update

        engine = self._engine()
        cfg = self.config
        engine.before_train()
        await _prepare_train(engine)
        start = time.perf_counter()
        world = cfg.launch.num_ranks
        prepared = prepare_update(rollout, cfg, self.versions.trainer_version)
        self.versions.dropped_stale_samples += prepared.stale
        bodies = prepared.bodies(world, engine.train_fields(world, self._sampling.next_request))
        trainer_version, reward_mean = self.versions.trainer_version, prepared.reward_mean
        with CallProgress(
            "update",
            unit="micro-batch",
            poll=lambda: self._run.command_progress("update"),  # summed over the ranks' heartbeats
            postfix=lambda: f"reward {reward_mean:.3f}, trainer v{trainer_version} -> v{trainer_version + 1}",
            enabled=progress,
        ):
            results = await self._broadcast("update", bodies, timeout_s=cfg.launch.command_timeout_s)
        self._record_trainer_version("update", results, engine)
        update_s, eos = time.perf_counter() - start, self.special_tokens.eos_token_ids
        stats = update_step_metrics(
            rollout, results, prepared, cfg, self.versions, eos, step=self.step, update_s=update_s
        )
        if self.metrics is not None:
            self.metrics.log(self.step, stats)
            self.metrics.log_text(self.step, "samples", samples_markdown(rollout))
        vocab = len(self.tokenizer) if self.tokenizer is not None else 0
        advantages_B = prepared.advantages_B[prepared.index_B]
        self._entropy_checked = warn_after_update(stats, advantages_B, cfg, vocab=vocab, checked=self._entropy_checked)
        logger.debug("update %d: %s", self.step, stats)
        return stats

    def _record_trainer_version(self, command: str, results: list[dict[str, Any]], engine: SessionEngine) -> None:
        """After an optimizer step on every rank (``update``, ``sft_update``): the ranks' one new version becomes the
        trainer's, and ``session.step`` advances; the engine sees the results (its ``after_train`` hook).
        Raises ``VersionError`` when the ranks disagree."""
        versions = {int(r["version"]) for r in results}
        if len(versions) != 1:
            raise VersionError(f"ranks disagree on the trainer version after {command}: {sorted(versions)}")
        engine.after_train(results, TrainerRanks(self._run))
        self.versions.trainer_version = versions.pop()
        set_log_context(version=self.versions.trainer_version)
        self.step += 1

    async def sync_weights(self) -> WeightInfo:
        """Publish the trainer's weights to the engine; verify it serves the trainer's version and checksum.

        Raises ``WeightMismatchError`` naming both versions/checksums when the engine does not serve exactly
        what the trainer published.
        """
        engine = self._engine()
        start = time.perf_counter()
        info = await engine.sync(TrainerRanks(self._run), self.versions.trainer_version)
        seconds = time.perf_counter() - start
        self.versions.trainer_checksum = info.checksum
        self.versions.record_sync(info.version, info.checksum, seconds)
        if self.metrics is not None:
            self.metrics.log(self.step, sync_metrics(info, seconds))
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
        from rlsdk.observe.update_stats import sft_step_metrics
        from rlsdk.train_batches import sft_bodies, sft_tensors

        engine = self._engine()
        world = self.config.launch.num_ranks
        tensors = sft_tensors(batch, lr, tokenizer=self.tokenizer, special_tokens=self.special_tokens, world=world)
        engine.before_train()
        await _prepare_train(engine)
        bodies = sft_bodies(tensors, lr, world, engine.train_fields)
        start = time.perf_counter()
        results = await self._broadcast("sft_update", bodies, timeout_s=self.config.launch.command_timeout_s)
        self._record_trainer_version("sft_update", results, engine)
        stats = sft_step_metrics(results, step=self.step, seconds=time.perf_counter() - start, versions=self.versions)
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
        from rlsdk.evaluation import check_eval_args, eval_rows, evaluate_policy

        engine = self._engine()
        check_eval_args(n, greedy, prefix)
        rows = await eval_rows(prompts, self.config, self.tokenizer, num_prompts, self._held_out)
        assert self.workflow is not None
        reward = functools.partial(reward_rollout, reward_fn=reward_fn, timeout_s=timeout_s)
        return await evaluate_policy(
            self, engine, rows, reward, n=n, greedy=greedy, threshold=pass_threshold, prefix=prefix
        )

    # ------------------------------------------------------------------ checkpoints and low-level calls
    async def save_checkpoint(self) -> Path:
        """Write ``OUTPUT/checkpoints/step_N`` atomically (N = trainer version); keeps ``train.keep_checkpoints``.

        A new Session continues from it exactly with ``train.resume_from`` (the path, or 'latest')."""
        from rlsdk.session_checkpoint import write_checkpoint

        self._engine()
        return await write_checkpoint(self, self._sampling.data_position(), self._broadcast)

    async def call(self, command: str, body: dict[str, Any] | list[dict[str, Any]] | None = None) -> list[Any]:
        """Send a raw command to every rank and gather the results (index = rank). ``noop`` measures latency."""
        self._engine()
        return await self._broadcast(command, body, timeout_s=self.config.launch.command_timeout_s)

    async def trace(self, *, timeout_s: float = 2.0) -> Any:
        """Every rank's collective trace and thread stacks, compared now: a ``TraceReport`` (``print`` it, or
        show it in a notebook). Works while a command is stuck. Needs ``launch.tracer`` (else: stacks only)."""
        self._check_open()
        return await self._run.trace(timeout_s)

    def _check_open(self) -> None:
        if self._run.channel is None or self._closed:
            raise SessionClosedError("the session is closed; start a new one with Session.start(config)")

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
        self._check_open()
        return await self._run.keep_waiting(timeout_s)

    def status(self) -> dict[str, Any]:
        """Ranks (pid, heartbeat age, current command and its ``(done, total)`` progress, alive), versions, the
        last batch's staleness verdict (``last_batch``: see :func:`rlsdk.observe.status.last_batch_staleness`),
        the latest collective trace's headline (``trace``) and a command the watchdog reported hung (``hung``),
        for humans and dashboards."""
        from rlsdk.observe.status import session_status

        return session_status(self, failure=self._run.failure, ranks=self._run.rank_status(running=not self._closed))

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
