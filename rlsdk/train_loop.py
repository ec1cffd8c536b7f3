"""The library's training loop: what ``Session.train`` runs (and so ``rlsdk run`` with a recipe's ``reward``).

One step is the four calls a notebook makes one cell at a time (``rollout -> reward -> update -> sync_weights``);
around them the loop honours the config's loop fields, or the arguments that override them:

- ``steps``: update steps to run now; default ``train.max_steps - session.step`` (a resumed run continues up to
  the same total, as TRL's and verl's ``max_steps`` / ``total_training_steps`` count).
- ``checkpoint_every`` (``train.checkpoint_every``): a checkpoint when ``session.step`` is a multiple; 0 = none
  on the way. The loop always ends with a checkpoint of its last step (``train.checkpoint_every``'s "0 = only at
  the end"), unless one was just written.
- ``eval_every`` (``train.eval_every``): ``Session.evaluate`` on the held-out prompts when ``session.step`` is a
  multiple, and after the last step; 0 = never (``eval_samples``: a sampled evaluation beside the greedy one).
- ``target_reward`` (``train.target_reward``): stop once the mean reward over the last ``observe.moving_average``
  steps reaches it (not before that many steps ran).

With ``rollout.mode='async'`` the same calls overlap generation with training (``Session.rollout`` hands out the
batch generated in the background). The loop returns a :class:`TrainSummary`.

The loop drives a :class:`LoopSession`, the few calls and attributes it needs, which ``Session`` has: this module
does not import the Session (``Session.train`` imports this one), so a test can drive the loop with a scripted
stand-in and the two modules form no import cycle.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlsdk.observe.logging import get_logger

if TYPE_CHECKING:
    from rlsdk.config import SessionConfig
    from rlsdk.rewards.apply import RewardFn
    from rlsdk.versioning import VersionLedger
    from rlsdk.workflow.rollout import Rollout

logger = get_logger(__name__)


class LoopSession(Protocol):
    """What :func:`train` drives: the four calls of a step, evaluation and checkpoints, and what it reads
    (``rlsdk.Session`` satisfies it)."""

    @property
    def config(self) -> SessionConfig: ...

    @property
    def step(self) -> int: ...

    @property
    def versions(self) -> VersionLedger: ...

    async def rollout(self) -> Rollout: ...

    async def reward(self, rollout: Rollout, reward_fn: RewardFn) -> Rollout: ...

    async def update(self, rollout: Rollout) -> dict[str, float]: ...

    async def sync_weights(self) -> object: ...

    async def evaluate(
        self, prompts: Any, reward_fn: RewardFn, *, n: int = 1, greedy: bool = True, prefix: str = "eval"
    ) -> dict[str, float]: ...

    async def save_checkpoint(self) -> Path: ...


@dataclass
class TrainSummary:
    """What a :func:`train` call did.

    Attributes:
        steps: Update steps this call ran.
        last_step: ``session.step`` at the end (counts resumed steps too).
        final_reward: Moving mean reward (``observe.moving_average`` steps) after the last step; NaN if none ran.
        best_reward: Highest moving mean reward seen in this call; NaN if no step ran.
        target_reward: The target this call stopped at, or None.
        target_metric: The update metric ``target_reward`` applies to (moving mean).
        reached_target_at: ``session.step`` when the moving mean of ``target_metric`` reached ``target_reward``;
            None if it never did.
        checkpoints: Checkpoint directories written, in order.
        evaluations: ``Session.evaluate`` results, each with its ``step``.
        rewards: ``reward/mean`` of each step of this call.
        seconds: Wall time of this call.
    """

    steps: int
    last_step: int
    final_reward: float
    best_reward: float
    target_reward: float | None
    target_metric: str
    reached_target_at: int | None
    checkpoints: list[Path] = field(default_factory=list)
    evaluations: list[dict[str, float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def reached_target(self) -> bool:
        """Whether the moving mean reward reached ``target_reward``."""
        return self.reached_target_at is not None

    def as_dict(self) -> dict[str, Any]:
        """Plain values (paths as strings), e.g. for JSON."""
        out = asdict(self)
        out["checkpoints"] = [str(p) for p in self.checkpoints]
        out["reached_target"] = self.reached_target
        return out


@dataclass(frozen=True)
class _Plan:
    """The loop's settings for one call: the arguments, else the config's values, validated."""

    steps: int
    checkpoint_every: int
    eval_every: int
    eval_samples: int
    target: float | None  # None: never stop early
    window: int  # observe.moving_average


def _check_every(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} is invalid: allowed an int >= 0 (0 = never)")
    return value


def _plan(
    session: LoopSession,
    steps: int | None,
    checkpoint_every: int | None,
    eval_every: int | None,
    eval_samples: int,
    target_reward: float | None,
) -> _Plan:
    config = session.config
    target = config.train.target_reward if target_reward is None else target_reward
    return _Plan(
        steps=_check_every("steps", max(config.train.max_steps - session.step, 0) if steps is None else steps),
        checkpoint_every=_check_every(
            "checkpoint_every", config.train.checkpoint_every if checkpoint_every is None else checkpoint_every
        ),
        eval_every=_check_every("eval_every", config.train.eval_every if eval_every is None else eval_every),
        eval_samples=_check_every("eval_samples", eval_samples),
        target=None if target is not None and math.isinf(target) and target > 0 else target,
        window=config.observe.moving_average,
    )


async def train(
    session: LoopSession,
    reward_fn: RewardFn,
    *,
    steps: int | None = None,
    checkpoint_every: int | None = None,
    eval_every: int | None = None,
    eval_prompts: Sequence[Any] | dict[str, list[Any]] | None = None,
    target_reward: float | None = None,
    target_metric: str = "reward/mean",
    progress: bool = True,
    on_step: Callable[[dict[str, float]], None] | None = None,
    eval_samples: int = 0,
) -> TrainSummary:
    """Run ``session``'s RL loop with ``reward_fn``; see the module docstring for what each argument overrides.

    ``None`` for ``steps``, ``checkpoint_every``, ``eval_every`` and ``target_reward`` means the config's value;
    ``checkpoint_every=0`` writes only the final checkpoint, ``eval_every=0`` never evaluates and
    ``target_reward=math.inf`` never stops early. ``eval_prompts``: what :meth:`Session.evaluate` scores (``None``:
    its held-out default). ``target_metric``: the :meth:`Session.update` metric whose moving mean
    ``target_reward`` applies to (e.g. one component of a :func:`~rlsdk.rewards.combine_rewards` reward,
    ``"reward/answer"``). ``progress``: a bar over the steps with the moving reward, loss and served version
    (tqdm: a widget in Jupyter, text in a terminal). ``on_step(stats)`` is called after each step's sync with
    :meth:`Session.update`'s metrics. ``eval_samples``: each evaluation also samples that many completions per
    prompt with the training sampling settings, logged as ``eval_sampled/*`` beside the greedy ``eval/*``
    (pass@1 and pass@n); 0 = greedy only.

    Raises:
        ValueError: a negative ``steps``, ``checkpoint_every``, ``eval_every`` or ``eval_samples``.
        KeyError: ``target_metric`` is not among the update's metrics (named, with the ones there are).
        and whatever the four calls raise (the session stays usable for ``restart``).
    """
    start = time.perf_counter()
    plan = _plan(session, steps, checkpoint_every, eval_every, eval_samples, target_reward)
    summary = TrainSummary(
        steps=0, last_step=session.step, final_reward=math.nan, best_reward=math.nan, target_reward=plan.target,
        target_metric=target_metric, reached_target_at=None,
    )  # fmt: skip
    targets: list[float] = []  # target_metric per step
    bar = _step_bar(plan.steps, progress)
    try:
        for _ in range(plan.steps):
            rollout = await session.reward(await session.rollout(), reward_fn)
            stats = await session.update(rollout)
            await session.sync_weights()
            _record_step(summary, stats, session.step, plan.window)
            _show_step(bar, summary, stats, session.versions.engine_version)
            if on_step is not None:
                on_step(stats)
            if _due(plan.checkpoint_every, session.step):
                summary.checkpoints.append(await session.save_checkpoint())
            if _due(plan.eval_every, session.step):
                summary.evaluations.append(await _evaluate(session, eval_prompts, reward_fn, plan.eval_samples))
            if plan.target is not None and _reached_target(
                summary, targets, stats, plan.target, plan.window, session.step
            ):
                break
        # after the last step: its evaluation and checkpoint, unless the schedule just wrote them
        if summary.steps and plan.eval_every and not _due(plan.eval_every, session.step):
            summary.evaluations.append(await _evaluate(session, eval_prompts, reward_fn, plan.eval_samples))
        if summary.steps and not _due(plan.checkpoint_every, session.step):
            summary.checkpoints.append(await session.save_checkpoint())
    finally:
        if bar is not None:
            bar.close()
    summary.seconds = time.perf_counter() - start
    _log_summary(summary)
    return summary


def _due(every: int, step: int) -> bool:
    """Whether a checkpoint or evaluation every ``every`` steps (0 = never) falls on ``step``."""
    return bool(every) and step % every == 0


def _moving_mean(values: list[float], window: int) -> float:
    recent = values[-window:]
    return sum(recent) / len(recent)


def _record_step(summary: TrainSummary, stats: dict[str, float], step: int, window: int) -> None:
    summary.steps += 1
    summary.last_step = step
    summary.rewards.append(stats["reward/mean"])
    summary.final_reward = _moving_mean(summary.rewards, window)
    if math.isnan(summary.best_reward) or summary.final_reward > summary.best_reward:
        summary.best_reward = summary.final_reward


def _reached_target(
    summary: TrainSummary, targets: list[float], stats: dict[str, float], target: float, window: int, step: int
) -> bool:
    """Append this step's ``target_metric`` to ``targets``; True (and the step noted) once its moving mean over a
    full window reaches ``target``."""
    metric = summary.target_metric
    if metric not in stats:
        raise KeyError(f"target_metric={metric!r} is not an update metric; there are: {sorted(stats)}")
    targets.append(stats[metric])
    moving = _moving_mean(targets, window)
    if len(targets) < window or moving < target:
        return False
    summary.reached_target_at = step
    logger.info("moving mean %s %.3f reached train.target_reward=%g at step %d", metric, moving, target, step)
    return True


def _log_summary(summary: TrainSummary) -> None:
    reached = summary.reached_target_at
    logger.info(
        "trained %d steps in %.1f s (step %d): moving reward %.3f, best %.3f%s",
        summary.steps,
        summary.seconds,
        summary.last_step,
        summary.final_reward,
        summary.best_reward,
        "" if reached is None else f", target {summary.target_reward:g} reached at step {reached}",
    )


async def _evaluate(session: LoopSession, prompts: Any, reward_fn: RewardFn, samples: int) -> dict[str, float]:
    result = await session.evaluate(prompts, reward_fn)
    if samples:
        result.update(await session.evaluate(prompts, reward_fn, n=samples, greedy=False, prefix="eval_sampled"))
    return {"step": float(session.step), **result}


def _step_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from rlsdk.observe.progress import make_bar

    return make_bar(total=total, desc="train", unit="step", leave=True)


def _show_step(bar: Any, summary: TrainSummary, stats: dict[str, float], version: int) -> None:
    if bar is None:
        return
    bar.update(1)
    bar.set_postfix(reward=f"{summary.final_reward:.3f}", loss=f"{stats['train/loss']:.4f}", version=version)
