"""Supervised fine-tuning through the Session on real ranks: an SFT step publishes version + 1 with the weights of
the one-process SFT step on the same batch (completion tokens only), a sync leaves the engine serving exactly those
weights (checksum), and evaluate() scores the held-out file of data.eval_path."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rlsdk import Session, SessionConfig
from rlsdk.config import DataConfig, LaunchConfig, ModelConfig, ObserveConfig, RolloutConfig, TrainConfig
from rlsdk.data.reasoning import ReasoningTask, answer_reward, build_reasoning_policy, write_reasoning_task
from rlsdk.data.sft import SFTBatches

pytestmark = pytest.mark.distributed

TASK = ReasoningTask(num_sft=64, num_rl=32, num_test=6, seed=1)


@pytest.fixture(scope="module")
def reasoning_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reasoning")
    paths = write_reasoning_task(root / "data", TASK)
    model = build_reasoning_policy(root / "model", task=TASK, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    return {**paths, "model": model}


def sft_config(files: dict[str, Path], output_dir: Path) -> SessionConfig:
    return SessionConfig(
        model=ModelConfig(path=str(files["model"])),
        launch=LaunchConfig(num_ranks=2, start_timeout_s=120.0, heartbeat_interval_s=0.5, heartbeat_timeout_s=20.0),
        train=TrainConfig(lr=3e-3, micro_batch_size=2),  # 2 micro-batches per rank: accumulation runs
        rollout=RolloutConfig(group_size=2, max_new_tokens=8),
        data=DataConfig(
            task="file", path=str(files["rl"]), chat_template=True, prompts_per_step=2, eval_path=str(files["test"])
        ),
        observe=ObserveConfig(output_dir=str(output_dir), console=False),
    )


def reference_sft_step(model_dir: Path, batch: dict[str, torch.Tensor], config: SessionConfig) -> tuple[float, dict]:
    """The same SFT step in one process: whole batch, one forward, AdamW as the ranks build it, clip 1.0."""
    from transformers import AutoModelForCausalLM

    from rlsdk.algorithms import completion_logprobs
    from rlsdk.algorithms.sft import sft_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train = config.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=train.betas, weight_decay=train.weight_decay)
    logprobs_B_C, _ = completion_logprobs(
        model, batch["prompt_ids_B_P"], batch["prompt_mask_B_P"], batch["completion_ids_B_C"],
        batch["completion_mask_B_C"],
    )  # fmt: skip
    loss, _ = sft_loss(logprobs_B_C, batch["completion_mask_B_C"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), train.max_grad_norm)
    optimizer.step()
    return float(loss.detach()), {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_sft_update_then_sync_engine_serves_the_sft_weights_and_evaluate_scores_the_eval_file(
    reasoning_files: dict[str, Path], tmp_path: Path
) -> None:
    config = sft_config(reasoning_files, tmp_path / "out")

    async def scenario() -> dict:
        out: dict = {}
        async with await Session.start(config) as session:
            batches = SFTBatches.from_file(str(reasoning_files["sft"]), session.tokenizer, 8, seed=0)
            out["batch"] = batch = batches.next_batch()
            out["v0_checksum"] = session.versions.trainer_checksum
            out["stats"] = await session.sft_update(batch)
            out["lagging"] = (session.versions.trainer_version, session.versions.engine_version)
            info = await session.sync_weights()
            out["synced"] = (info.version, info.checksum, session.versions.trainer_checksum)
            out["engine_weights"] = {k: v.detach().clone() for k, v in session.engine.model.state_dict().items()}
            with pytest.raises(ValueError, match="multiple of 2"):
                await session.sft_update({k: v[:3] for k, v in batch.items()})
            rows = [{"prompt": "What is 1 + 2?", "completion": "The answer is 3."}] * 2
            out["rows_stats"] = await session.sft_update(rows)  # text rows, tokenised by the session
            out["eval"] = await session.evaluate(None, answer_reward)
            out["history"] = [dict(m) for _, m in session.metrics.history]
        return out

    out = asyncio.run(scenario())

    stats, batch = out["stats"], out["batch"]
    assert out["lagging"] == (1, 0)  # published v1; the engine serves v0 until the sync
    version, engine_checksum, trainer_checksum = out["synced"]
    assert version == 1 and engine_checksum == trainer_checksum != out["v0_checksum"]
    assert stats["sft/tokens"] == float(batch["completion_mask_B_C"].sum())  # completion tokens only
    assert stats["sft/sequences"] == 8.0 and stats["step"] == 1.0 and stats["version/trainer"] == 1.0
    reference_loss, reference_weights = reference_sft_step(reasoning_files["model"], batch, config)
    assert stats["sft/loss"] == pytest.approx(reference_loss, rel=1e-5)
    for name, weight in reference_weights.items():
        torch.testing.assert_close(out["engine_weights"][name], weight, rtol=1e-4, atol=2e-5, msg=name)
    assert out["rows_stats"]["version/trainer"] == 2.0 and out["rows_stats"]["sft/sequences"] == 2.0
    assert out["eval"]["eval/num_prompts"] == 6.0  # every row of data.eval_path
    assert any("sft/loss" in m for m in out["history"]) and any("eval/pass@1" in m for m in out["history"])


def test_session_start_with_a_missing_eval_path_raises_config_error_before_any_process(
    reasoning_files: dict[str, Path], tmp_path: Path
) -> None:
    import dataclasses

    from rlsdk.config import ConfigError

    config = sft_config(reasoning_files, tmp_path / "out")
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, eval_path=str(tmp_path / "no.jsonl")))

    with pytest.raises(ConfigError, match=r"data\.eval_path"):
        asyncio.run(Session.start(config))
    assert not (tmp_path / "out" / "logs").exists()  # nothing started


@pytest.mark.slow
def test_recipe_runs_sft_then_evaluate_then_five_grpo_steps_from_the_verified_sft_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlsdk.cli import run_recipe
    from rlsdk.engine.train.checkpoint import verify_checkpoint

    monkeypatch.chdir(tmp_path)  # the recipe builds its data and model under ./outputs, as from a clean clone
    recipe = Path(__file__).parents[2] / "recipes" / "sft_then_grpo.py"
    flags = ["--sft.steps", "40", "--sft.eval-every", "20", "--sft.warmup-steps", "5", "--train.max-steps", "5",
             "--train.eval-every", "5", "--eval-samples", "2",
             "--observe.output-dir", str(tmp_path / "run")]  # fmt: skip

    summary = run_recipe(str(recipe), flags)

    sft, rl = summary["sft"], summary["rl"]
    assert [e["step"] for e in sft["evaluations"]] == [20.0, 40.0]
    assert [e["step"] for e in rl["evaluations"]] == [0.0, 5.0] and rl["steps"] == 5 and len(rl["rewards"]) == 5
    # GRPO starts from the SFT'd weights: its first greedy evaluation is SFT's last one, to the problem
    assert rl["evaluations"][0]["eval/pass@1"] == sft["evaluations"][-1]["eval/pass@1"]
    assert all("eval_sampled/pass@1" in e for e in sft["evaluations"] + rl["evaluations"])
    verify_checkpoint(Path(sft["checkpoint"]))  # signed, every file as written
    assert Path(rl["checkpoint"]).name == "step_5"
    for phase in ("sft", "rl"):
        assert list((tmp_path / "run" / phase / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "run" / "summary.json").is_file()
    assert (tmp_path / "outputs" / "data" / "addition" / "test.jsonl").is_file()


@pytest.mark.slow
def test_recipe_with_lora_trains_every_weight_in_sft_and_only_adapters_in_grpo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("peft", reason="LoRA needs peft: install the lora extra")
    from rlsdk.cli import run_recipe
    from rlsdk.engine.lora import is_adapter_dir

    monkeypatch.chdir(tmp_path)
    recipe = Path(__file__).parents[2] / "recipes" / "sft_then_grpo.py"
    flags = ["--sft.steps", "40", "--sft.eval-every", "40", "--sft.warmup-steps", "5", "--train.max-steps", "3",
             "--train.eval-every", "3", "--eval-samples", "0", "--train.lora-rank", "4", "--train.lora-alpha", "8",
             "--train.lr", "5e-3", "--observe.output-dir", str(tmp_path / "run")]  # fmt: skip

    summary = run_recipe(str(recipe), flags)

    sft_model, rl_model = Path(summary["sft"]["checkpoint"]) / "model", Path(summary["rl"]["checkpoint"]) / "model"
    assert (sft_model / "config.json").is_file() and not is_adapter_dir(sft_model)  # SFT: every weight
    assert is_adapter_dir(rl_model) and not (rl_model / "config.json").is_file()  # GRPO: the adapter only
    assert summary["rl"]["steps"] == 3
    assert summary["rl"]["evaluations"][0]["eval/pass@1"] == summary["sft"]["evaluations"][-1]["eval/pass@1"]
