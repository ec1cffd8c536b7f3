"""The per-step metric functions: pure, namespaced, computed from a Rollout."""

from __future__ import annotations

import math

import pytest
import torch

from rlsdk.algorithms.entropy_check import entropy_bonus_ratio, suggested_entropy_coef
from rlsdk.observe.rollout_metrics import (
    completion_metrics,
    finish_reasons,
    pass_metrics,
    reward_metrics,
    samples_markdown,
    throughput_metrics,
    update_metrics,
)
from rlsdk.workflow.rollout import Rollout

EOS = 1


def _rollout(ids: list[list[int]], lengths: list[int], *, info: dict | None = None) -> Rollout:
    batch, width = len(ids), len(ids[0])
    mask_B_C = torch.arange(width).expand(batch, width) < torch.tensor(lengths).unsqueeze(1)
    return Rollout(
        rows=[{"prompt": f"p{g}|x"} for g in range(batch // 2)],
        group_size=2,
        prompt_ids_B_P=torch.ones(batch, 2, dtype=torch.long),
        prompt_mask_B_P=torch.ones(batch, 2, dtype=torch.bool),
        completion_ids_B_C=torch.tensor(ids),
        completion_mask_B_C=mask_B_C,
        logprobs_B_C=torch.zeros(batch, width),
        versions_B_C=torch.where(mask_B_C, 0, -1),
        completions=[f"c{b}" for b in range(batch)],
        rewards_B=torch.tensor([1.0, 0.0, 0.5, 1.0]),
        info=info or {},
    )


def test_completion_metrics_from_tokens_count_eos_truncation_and_lengths() -> None:
    # row 0 ends with EOS, row 1 hits max_new_tokens (4), row 2 was cut by a workflow, row 3 EOS at once
    rollout = _rollout([[5, 6, EOS, 0], [5, 6, 7, 8], [5, 6, 0, 0], [EOS, 0, 0, 0]], [3, 4, 2, 1])

    metrics = completion_metrics(rollout, max_new_tokens=4, eos_token_ids=[EOS])

    assert metrics == {
        "completion/len_mean": 2.5,
        "completion/len_max": 4.0,
        "completion/len_min": 1.0,
        "completion/eos_rate": 0.5,
        "completion/stop_rate": 0.25,
        "completion/truncated_rate": 0.25,
    }


def test_finish_reasons_prefer_the_workflow_record() -> None:
    recorded = ["stop", "eos", "length", "eos"]
    rollout = _rollout([[5, 6, EOS, 0]] * 4, [3] * 4, info={"finish_reasons": recorded})

    assert finish_reasons(rollout, max_new_tokens=4, eos_token_ids=[EOS]) == recorded


def test_reward_metrics_include_components_and_pass_metrics_count_groups() -> None:
    rollout = _rollout([[5, 0, 0, 0]] * 4, [1] * 4, info={"reward_components": {"fmt": torch.tensor([1.0] * 4)}})

    rewards = reward_metrics(rollout)
    passed = pass_metrics(rollout.rewards_B, 2)

    assert rewards["reward/mean"] == pytest.approx(0.625, abs=1e-6) and rewards["reward/fmt"] == 1.0
    assert passed == {"eval/pass@1": 0.5, "eval/pass@2": 1.0}


def test_throughput_metrics_when_time_unknown_gives_nan() -> None:
    metrics = throughput_metrics(rollout_tokens=100, rollout_s=0.5, update_tokens=100, update_s=float("nan"))

    assert metrics["throughput/rollout_tokens_per_s"] == 200.0
    assert math.isnan(metrics["throughput/update_tokens_per_s"])


def test_samples_markdown_escapes_table_separators() -> None:
    text = samples_markdown(_rollout([[5, 0, 0, 0]] * 4, [1] * 4), count=1)

    assert text.splitlines()[2] == "| p0\\|x | c0 | 1.000 |"


def test_entropy_bonus_ratio_compares_bonus_with_advantage_scale() -> None:
    advantages_B = torch.tensor([0.5, -0.5, 0.0, 0.0])

    assert entropy_bonus_ratio(0.1, 2.5, advantages_B) == pytest.approx(1.0)
    assert entropy_bonus_ratio(0.0, 2.5, advantages_B) == 0.0
    assert math.isinf(entropy_bonus_ratio(0.1, 2.5, torch.zeros(4)))
    assert suggested_entropy_coef(advantages_B, 2.5) == pytest.approx(0.01)


def test_render_samples_html_shows_the_latest_samples_table_escaped() -> None:
    from rlsdk.observe.dashboard import render_samples_html

    text = samples_markdown(_rollout([[5, 0, 0, 0]] * 4, [1] * 4), count=1)

    out = render_samples_html({"samples": (7, text)})

    assert "(step 7)" in out and "<th>prompt</th>" in out and "<td>p0|x</td>" in out and "---" not in out


def _rank_result(tokens: float, **overrides: float) -> dict[str, float]:
    result = {
        "loss_sum": 2.0, "clipped_tokens": 1.0, "ratio_sum": tokens, "kl_sum": 0.5, "entropy_sum": 3.0,
        "tokens": tokens, "logprob_absdiff_sum": 0.2, "ratio_dev_sq_sum": 0.04, "objective": 0.6,
        "is_weight_sum": tokens, "is_capped_tokens": 0.0, "logprob_absdiff_max": 0.1, "ratio_max": 1.2,
        "neg_ratio_min": -0.9, "grad_norm": 1.5, "lr": 1e-3, "optimizer_steps": 2.0, "seconds": 0.3,
        "agreement_tokens": tokens, "ratio_limited_tokens": 0.0,
    }  # fmt: skip
    result.update(overrides)
    return result


def test_update_metrics_sums_rank_shards_into_token_means_and_takes_rank0_optimizer_state() -> None:
    results = [_rank_result(4.0), _rank_result(6.0, logprob_absdiff_max=0.4, neg_ratio_min=-0.7, seconds=0.5)]

    metrics = update_metrics(results, world=2)

    assert metrics["train/tokens"] == 10.0
    assert metrics["train/loss"] == pytest.approx(4.0 / 10.0, rel=1e-12)
    assert metrics["train/objective"] == pytest.approx(1.2 / 2, rel=1e-12)  # DDP averages each rank's share
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, rel=1e-12)
    assert metrics["agreement/logprob_absdiff_mean"] == pytest.approx(0.04, rel=1e-12)
    assert metrics["agreement/logprob_absdiff_max"] == 0.4
    assert metrics["agreement/ratio_rms_dev"] == pytest.approx(math.sqrt(0.008), rel=1e-12)
    assert metrics["agreement/ratio_min"] == 0.7
    assert metrics["agreement/tokens"] == 10.0 and metrics["train/ratio_limited_fraction"] == 0.0
    assert metrics["train/grad_norm"] == 1.5 and metrics["train/optimizer_steps"] == 2.0
    assert metrics["time/rank_update_s"] == 0.5
    assert all(key.split("/")[0] in {"train", "agreement", "time"} for key in metrics)
