"""The held-out prompts of ``Session.evaluate(None, ...)``: every row of ``data.eval_path`` (or the first
``num_prompts``), prepared exactly as the training prompts are; bad files name ``data.eval_path`` /
``data.eval_split``; the dashboard plots the held-out pass@1 beside the training curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlsdk.config import ConfigError, DataConfig, ModelConfig, SessionConfig
from rlsdk.data.reasoning import ReasoningTask, build_reasoning_tokenizer
from rlsdk.evaluation import held_out_prompts
from rlsdk.observe.dashboard import render_metrics_html


@pytest.fixture(scope="module")
def tokenizer():
    return build_reasoning_tokenizer(ReasoningTask(num_sft=20, num_rl=20, num_test=5))


def _config(tmp_path: Path, **data: object) -> SessionConfig:
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    fields = {"task": "file", "path": str(train), "prompt_column": "question", **data}
    return SessionConfig(model=ModelConfig(path="unused"), data=DataConfig(**fields))  # type: ignore[arg-type]


def test_held_out_prompts_of_eval_path_are_every_row_prepared_like_the_training_prompts(tmp_path, tokenizer) -> None:
    held_out = tmp_path / "test.jsonl"
    held_out.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                                for i in range(5)))  # fmt: skip
    config = _config(tmp_path, eval_path=str(held_out), chat_template=True)

    every = held_out_prompts(config, tokenizer, None)
    first = held_out_prompts(config, tokenizer, 2)

    assert [row["answer"] for row in every] == ["1", "2", "3", "4", "5"] and first == every[:2]
    assert every[0]["prompt"] == "<|im_start|>user\nWhat is 0 + 1?<|im_end|>\n<|im_start|>assistant\n"
    assert every[0]["question"] == "What is 0 + 1?"  # the other columns reach the reward function


def test_held_out_prompts_bad_eval_file_raises_config_error_naming_eval_fields(tmp_path, tokenizer) -> None:
    import datasets

    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"question": ["q"]})}).save_to_disk(tmp_path / "dd")

    with pytest.raises(ConfigError, match=r"data\.eval_path="):
        held_out_prompts(_config(tmp_path, eval_path=str(tmp_path / "missing.jsonl")), tokenizer, None)
    with pytest.raises(ConfigError, match=r"data\.eval_split='validation'.*\['test'\]"):
        held_out_prompts(_config(tmp_path, eval_path=str(tmp_path / "dd"), eval_split="validation"), tokenizer, None)
    assert len(held_out_prompts(_config(tmp_path, eval_path=str(tmp_path / "dd")), tokenizer, None)) == 1
    with pytest.raises(ValueError, match=r"no data\.eval_path"):
        held_out_prompts(_config(tmp_path), tokenizer, None)
    with pytest.raises(ConfigError, match=r"DataConfig\.eval_path"):
        DataConfig(eval_path=" ")


def test_dashboard_plots_held_out_pass_at_1_always_and_sft_loss_once_logged() -> None:
    rl_only = render_metrics_html([(1, {"reward/mean": 0.5}), (2, {"eval/pass@1": 0.4})])
    with_sft = render_metrics_html([(1, {"sft/loss": 0.9}), (2, {"sft/loss": 0.4, "eval/pass@1": 0.3})])

    assert "held-out pass@1 (greedy)" in rl_only and "SFT loss" not in rl_only
    assert "SFT loss" in with_sft and "held-out pass@1 (sampled)" not in with_sft


def test_eval_metrics_with_a_prefix_renames_every_namespace_and_counts_prompts_not_samples() -> None:
    import torch

    from rlsdk.evaluation import eval_metrics
    from rlsdk.workflow.rollout import Rollout

    mask_B_C = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    rollout = Rollout(
        rows=[{"prompt": "a"}, {"prompt": "b"}],
        group_size=2,
        prompt_ids_B_P=torch.ones(4, 1, dtype=torch.long),
        prompt_mask_B_P=torch.ones(4, 1, dtype=torch.bool),
        completion_ids_B_C=torch.tensor([[3, 1], [1, 0], [3, 3], [3, 1]]),
        completion_mask_B_C=mask_B_C,
        logprobs_B_C=torch.zeros(4, 2),
        versions_B_C=torch.where(mask_B_C, 2, -1),
        completions=["x", "", "xx", "x"],
        rewards_B=torch.tensor([1.0, 0.0, 0.0, 1.0]),
    )

    metrics = eval_metrics(
        rollout, n=2, pass_threshold=1.0, max_new_tokens=2, eos_token_ids=[1], engine_version=5, seconds=0.1,
        prefix="eval_sampled",
    )  # fmt: skip

    assert metrics["eval_sampled/num_prompts"] == 2.0
    assert metrics["eval_sampled/engine_version"] == 2.0  # the version that sampled, not the one serving now
    assert metrics["eval_sampled/pass@1"] == pytest.approx(0.5, rel=1e-12)
    assert metrics["eval_sampled/reward_mean"] == pytest.approx(0.5, rel=1e-12)
    assert all(key.startswith("eval_sampled/") for key in metrics)


def test_check_eval_args_greedy_with_several_samples_raises_naming_n() -> None:
    from rlsdk.evaluation import check_eval_args

    with pytest.raises(ValueError, match="n=2 is invalid"):
        check_eval_args(2, True, "eval")
    with pytest.raises(ValueError, match="prefix='a/b' is invalid"):
        check_eval_args(1, True, "a/b")
