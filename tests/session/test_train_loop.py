"""The library loop (``Session.train``) and ``Session.evaluate`` on real ranks: the config's loop fields are
honoured unless the arguments override them; metrics users look for; pre-start log records; 'auto' resume."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from rlsdk import Session, SessionConfig
from rlsdk.config import AlgorithmConfig, DataConfig, TrainConfig
from rlsdk.rewards import reverse_reward
from rlsdk.session import load_resume_state

pytestmark = pytest.mark.distributed


@pytest.fixture()
def loop_config(small_config: SessionConfig) -> SessionConfig:
    return dataclasses.replace(
        small_config,
        train=dataclasses.replace(small_config.train, max_steps=3, checkpoint_every=2, eval_every=2),
        # a bonus far above the advantage scale of a first batch: the Session must warn
        algorithm=AlgorithmConfig(entropy_coef=5.0),
        # 4-digit prompts are 5 tokens: dropped before launch, and the message must still reach the logs
        data=DataConfig(prompts_per_step=4, num_examples=64, min_digits=3, max_digits=4, max_prompt_tokens=4),
        observe=dataclasses.replace(small_config.observe, moving_average=2),
    )


def _steps(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def test_session_train_honours_config_fields_then_arguments_and_auto_resume_continues(
    loop_config: SessionConfig,
) -> None:
    async def scenario() -> dict:
        out: dict = {}
        stats: list[dict[str, float]] = []
        async with await Session.start(loop_config) as session:
            # the config: train.max_steps=3, checkpoint_every=2, eval_every=2, no target
            out["config"] = await session.train(reverse_reward, progress=False, on_step=stats.append)
            out["history"] = [dict(m) for _, m in session.metrics.history]
            out["texts"] = dict(session.metrics.texts)
            # the arguments: 4 more steps at most, no evaluation, only the final checkpoint, a target reached
            # as soon as the moving mean (2 steps) exists
            out["args"] = await session.train(
                reverse_reward, steps=4, checkpoint_every=0, eval_every=0, target_reward=-1.0, progress=False
            )
            held_out = [{"prompt": "123>", "answer": "321"}, {"prompt": "456>", "answer": "654"}]
            out["greedy"] = await session.evaluate(held_out, reverse_reward)
            out["sampled"] = await session.evaluate(None, reverse_reward, n=4, greedy=False, num_prompts=3)
            with pytest.raises(ValueError, match="greedy"):
                await session.evaluate(held_out, reverse_reward, n=2)
        out["start_seconds"], out["close_seconds"] = dict(session.start_seconds), dict(session.close_seconds)
        out["stats"] = stats
        auto = dataclasses.replace(loop_config, train=dataclasses.replace(loop_config.train, resume_from="auto"))
        async with await Session.start(auto) as resumed:
            out["resumed"] = (resumed.resumed_from, resumed.step)
            out["resumed_train"] = await resumed.train(reverse_reward, progress=False)  # max_steps 3 < step 5
        return out

    out = asyncio.run(scenario())

    first, second = out["config"], out["args"]
    assert (first.steps, first.last_step, first.reached_target_at) == (3, 3, None)
    assert _steps(first.checkpoints) == ["step_2", "step_3"]  # every 2 steps, and after the last one
    assert [e["step"] for e in first.evaluations] == [2.0, 3.0]  # every 2 steps, and after the last one
    assert all(0.0 <= e["eval/pass@1"] <= 1.0 and "eval/reward_mean" in e for e in first.evaluations)
    assert len(first.rewards) == 3 and first.final_reward == pytest.approx(sum(first.rewards[-2:]) / 2)
    assert (second.steps, second.reached_target_at, second.target_reward) == (2, 5, -1.0)
    assert _steps(second.checkpoints) == ["step_5"] and second.evaluations == []
    assert second.reached_target and second.as_dict()["checkpoints"][0].endswith("step_5")
    logged_evals = [m for m in out["history"] if "eval/reward_mean" in m]
    assert len(logged_evals) == 2  # TensorBoard got both evaluations
    assert "| prompt | completion | reward |" in out["texts"]["samples"][1]
    assert out["texts"]["eval/samples"][0] == 3  # step of the last evaluation
    assert out["greedy"]["eval/num_prompts"] == 2.0 and "eval/pass@4" not in out["greedy"]
    assert out["sampled"]["eval/num_prompts"] == 3.0 and 0.0 <= out["sampled"]["eval/pass@4"] <= 1.0
    assert out["sampled"]["eval/pass@1"] <= out["sampled"]["eval/pass@4"]
    step = out["stats"][0]
    for key in ("completion/len_mean", "completion/len_max", "completion/len_min", "completion/eos_rate",
                "completion/truncated_rate", "throughput/rollout_tokens_per_s", "time/reward_s"):  # fmt: skip
        assert key in step, key
    assert step["completion/len_min"] <= step["completion/len_mean"] <= step["completion/len_max"] <= 5
    assert step["completion/eos_rate"] + step["completion/stop_rate"] + step["completion/truncated_rate"] == (
        pytest.approx(1.0)
    )
    for key in ("checks", "ranks/launcher", "ranks/rank_imports", "ranks/train_engine", "phase/initialising ranks",
                "total"):  # fmt: skip
        assert key in out["start_seconds"], key
    assert {"ranks_exit", "engine", "total"} <= set(out["close_seconds"])
    assert out["resumed"][0] is not None and out["resumed"][0].name == "step_5" and out["resumed"][1] == 5
    assert out["resumed_train"].steps == 0 and out["resumed_train"].checkpoints == []
    controller_log = (Path(loop_config.observe.output_dir) / "logs" / "controller.log").read_text()
    assert "prompts longer than data.max_prompt_tokens=4" in controller_log  # logged before launch, not lost
    assert "algorithm.entropy_coef=5" in controller_log and "mean |advantage|" in controller_log


def test_load_resume_state_auto_without_checkpoint_starts_fresh(small_config: SessionConfig) -> None:
    config = dataclasses.replace(small_config, train=dataclasses.replace(small_config.train, resume_from="auto"))

    assert load_resume_state(config) is None


def test_session_train_bad_arguments_raise_naming_them(small_config: SessionConfig) -> None:
    from rlsdk.train_loop import train

    class _Fake:
        config = small_config
        step = 0

    with pytest.raises(ValueError, match="checkpoint_every=-1"):
        asyncio.run(train(_Fake(), reverse_reward, checkpoint_every=-1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"steps=1\.5"):
        asyncio.run(train(_Fake(), reverse_reward, steps=1.5))  # type: ignore[arg-type]


def test_train_config_eval_every_negative_raises_naming_field() -> None:
    from rlsdk.config import ConfigError

    with pytest.raises(ConfigError) as info:
        TrainConfig(eval_every=-1)

    assert info.value.field == "TrainConfig.eval_every"
    assert TrainConfig().eval_every == 0  # never, unless asked


def test_session_train_in_async_rollout_mode_trains_and_checkpoints(small_config: SessionConfig) -> None:
    config = dataclasses.replace(
        small_config, rollout=dataclasses.replace(small_config.rollout, mode="async", max_staleness=1)
    )

    async def scenario():
        async with await Session.start(config) as session:
            summary = await session.train(reverse_reward, steps=3, checkpoint_every=2, progress=False)
            return summary, session.versions.trainer_version

    summary, version = asyncio.run(scenario())

    assert (summary.steps, version) == (3, 3)
    assert _steps(summary.checkpoints) == ["step_2", "step_3"]


def test_rank_startup_seconds_takes_the_slowest_rank_of_each_span() -> None:
    from rlsdk.session import rank_startup_seconds

    marks = [
        {"process_start": 11.0, "imported": 13.0, "connected": 13.5, "process_group": 14.0, "init_begin": 14.1,
         "init_end": 16.0},
        {"process_start": 12.0, "imported": 13.0, "connected": 13.2, "process_group": 14.0, "init_begin": 14.1,
         "init_end": 15.0},
    ]  # fmt: skip

    spans = rank_startup_seconds(10.0, marks)

    assert spans == pytest.approx(
        {"ranks/launcher": 2.0, "ranks/rank_imports": 2.0, "ranks/rank_connect": 0.5, "ranks/process_group": 0.8,
         "ranks/train_engine": 1.9}
    )  # fmt: skip
    assert rank_startup_seconds(10.0, [marks[0], None]) == {}
