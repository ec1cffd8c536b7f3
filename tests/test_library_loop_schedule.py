"""The library loop (``rlsdk.train_loop.train``) driven through its ``LoopSession`` protocol by a scripted session:
the schedule of checkpoints, evaluations and the early stop, without ranks (tests/session/test_train_loop.py runs
the same loop on a real Session)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from rlsdk.config import ModelConfig, ObserveConfig, SessionConfig, TrainConfig
from rlsdk.train_loop import LoopSession, TrainSummary, train
from rlsdk.versioning import VersionLedger


class ScriptedSession:
    """A LoopSession whose updates report the given rewards in turn and which records every call it gets."""

    def __init__(self, config: SessionConfig, rewards: list[float], *, step: int = 0) -> None:
        self.config = config
        self.step = step
        self.versions = VersionLedger()
        self.calls: list[str] = []
        self._rewards = iter(rewards)

    async def rollout(self) -> Any:
        self.calls.append("rollout")
        return "rollout"

    async def reward(self, rollout: Any, reward_fn: Any) -> Any:
        self.calls.append("reward")
        return rollout

    async def update(self, rollout: Any) -> dict[str, float]:
        self.calls.append("update")
        self.step += 1
        return {"reward/mean": next(self._rewards), "train/loss": 0.25}

    async def sync_weights(self) -> object:
        self.calls.append("sync")
        self.versions.engine_version = self.step
        return None

    async def evaluate(
        self, prompts: Any, reward_fn: Any, *, n: int = 1, greedy: bool = True, prefix: str = "eval"
    ) -> dict[str, float]:
        self.calls.append(f"evaluate:{prefix}:{n}")
        return {f"{prefix}/reward_mean": 0.5}

    async def save_checkpoint(self) -> Path:
        self.calls.append(f"checkpoint:{self.step}")
        return Path(f"step_{self.step}")


def _config(**train: Any) -> SessionConfig:
    return SessionConfig(
        model=ModelConfig(path="unused-by-the-loop"),
        train=TrainConfig(**train),
        observe=ObserveConfig(moving_average=2),
    )


def _train(session: LoopSession, **kwargs: Any) -> TrainSummary:
    return asyncio.run(train(session, lambda rows: [0.0] * len(rows), progress=False, **kwargs))


def _checkpoint_steps(summary: TrainSummary) -> list[str]:
    return [p.name for p in summary.checkpoints]


def test_train_with_config_schedule_checkpoints_and_evaluates_on_multiples_and_after_the_last_step() -> None:
    session = ScriptedSession(_config(max_steps=5, checkpoint_every=2, eval_every=2), [0.1, 0.2, 0.3, 0.4, 0.5])

    summary = _train(session)

    assert session.calls[:4] == ["rollout", "reward", "update", "sync"]  # one step is the four calls, in order
    assert (summary.steps, summary.last_step, summary.reached_target_at) == (5, 5, None)
    assert _checkpoint_steps(summary) == ["step_2", "step_4", "step_5"]
    assert [e["step"] for e in summary.evaluations] == [2.0, 4.0, 5.0]
    assert summary.rewards == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert summary.final_reward == pytest.approx(0.45, rel=1e-9, abs=1e-12)  # moving mean of the last 2 steps
    assert summary.best_reward == pytest.approx(0.45, rel=1e-9, abs=1e-12)


def test_train_when_the_last_step_is_on_the_schedule_writes_its_checkpoint_and_evaluation_once() -> None:
    session = ScriptedSession(_config(max_steps=4, checkpoint_every=2, eval_every=4), [0.0] * 4)

    summary = _train(session, eval_samples=3)

    assert session.calls.count("checkpoint:4") == 1 and _checkpoint_steps(summary) == ["step_2", "step_4"]
    assert [e["step"] for e in summary.evaluations] == [4.0]
    assert session.calls.count("evaluate:eval_sampled:3") == 1  # the sampled evaluation beside the greedy one
    assert set(summary.evaluations[0]) == {"step", "eval/reward_mean", "eval_sampled/reward_mean"}


def test_train_when_the_moving_mean_reaches_the_target_stops_and_checkpoints_that_step() -> None:
    session = ScriptedSession(_config(max_steps=10), [0.1, 0.5, 0.9, 0.9, 0.9])

    summary = _train(session, target_reward=0.8, checkpoint_every=0)

    # step 3's moving mean (0.5, 0.9) is 0.7; step 4's (0.9, 0.9) reaches 0.8
    assert (summary.steps, summary.reached_target_at, summary.reached_target) == (4, 4, True)
    assert _checkpoint_steps(summary) == ["step_4"] and summary.evaluations == []
    assert summary.best_reward == pytest.approx(0.9, rel=1e-9, abs=1e-12)


def test_train_with_an_infinite_target_never_stops_early() -> None:
    session = ScriptedSession(_config(max_steps=3, target_reward=0.0), [1.0, 1.0, 1.0])

    summary = _train(session, target_reward=math.inf)

    assert (summary.steps, summary.target_reward, summary.reached_target_at) == (3, None, None)


def test_train_after_a_resume_runs_up_to_max_steps_in_total() -> None:
    session = ScriptedSession(_config(max_steps=5), [0.0, 0.0], step=3)

    summary = _train(session)

    assert (summary.steps, summary.last_step) == (2, 5)
    assert _checkpoint_steps(summary) == ["step_5"]


def test_train_with_no_steps_left_writes_nothing() -> None:
    session = ScriptedSession(_config(max_steps=2, eval_every=1), [], step=3)

    summary = _train(session)

    assert (summary.steps, summary.checkpoints, summary.evaluations, session.calls) == (0, [], [], [])
    assert math.isnan(summary.final_reward) and math.isnan(summary.best_reward)


def test_train_target_metric_not_an_update_metric_raises_naming_it_and_the_metrics_there_are() -> None:
    session = ScriptedSession(_config(max_steps=2), [0.0, 0.0])

    with pytest.raises(KeyError, match=r"target_metric='reward/answer'.*'reward/mean', 'train/loss'"):
        _train(session, target_reward=0.5, target_metric="reward/answer")
