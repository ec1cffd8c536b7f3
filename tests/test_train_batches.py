"""``prepare_update``: the batch an RL update sends the ranks, its normalisers, advantages and what it drops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlsdk.config import AlgorithmConfig, DataConfig, ModelConfig, RolloutConfig, SessionConfig, TrainConfig
from rlsdk.train_batches import prepare_update
from rlsdk.versioning import StaleRolloutError, VersionError
from rlsdk.workflow.rollout import Rollout

# 2 prompts x 4 samples. Rows 1 and 4 come from v0: too stale for trainer v2 with max_staleness 1. Row 0 comes from
# v1 (one version behind: kept, but not the trainer's own weights).
LENGTHS = [1, 2, 3, 4, 5, 1, 2, 5]
VERSIONS = [1, 0, 2, 2, 0, 2, 2, 2]
REWARDS = [1.0, 0.0, 0.0, 0.0, 2.0, 1.0, 0.0, 1.0]
KEPT = [0, 2, 3, 5, 6, 7]
TRAINER_VERSION = 2


def _rollout(versions: list[int] = VERSIONS) -> Rollout:
    mask_B_C = torch.arange(5)[None, :] < torch.tensor(LENGTHS)[:, None]
    return Rollout(
        rows=[{"prompt": "a"}, {"prompt": "b"}],
        group_size=4,
        prompt_ids_B_P=torch.arange(8)[:, None].repeat(1, 2),
        prompt_mask_B_P=torch.ones(8, 2, dtype=torch.bool),
        completion_ids_B_C=torch.where(mask_B_C, 7, 0),
        completion_mask_B_C=mask_B_C,
        logprobs_B_C=torch.where(mask_B_C, -torch.arange(1.0, 9.0)[:, None], 0.0),
        versions_B_C=torch.where(mask_B_C, torch.tensor(versions)[:, None], -1),
        completions=["x"] * 8,
        rewards_B=torch.tensor(REWARDS),
    )


def _config(
    model_dir: Path, *, mini_batch_size: int | None = 4, scale_rewards: bool = True, policy: str = "drop"
) -> SessionConfig:
    return SessionConfig(
        model=ModelConfig(path=str(model_dir)),
        train=TrainConfig(mini_batch_size=mini_batch_size),
        rollout=RolloutConfig(group_size=4, max_staleness=1, stale_policy=policy),  # type: ignore[arg-type]
        data=DataConfig(prompts_per_step=2),
        algorithm=AlgorithmConfig(name="grpo", scale_rewards=scale_rewards),
    )


def test_prepare_update_with_stale_rows_dropped_leaves_them_out_of_every_count_and_normaliser(
    tiny_model_dir: Path,
) -> None:
    prepared = prepare_update(_rollout(), _config(tiny_model_dir), TRAINER_VERSION)

    assert prepared.stale == 2
    assert prepared.index_B.tolist() == KEPT
    assert prepared.batch["completion_mask_B_C"].sum(dim=1).tolist() == [1, 3, 4, 1, 2, 5]
    assert prepared.shared["num_tokens"] == 1 + 3 + 4 + 1 + 2 + 5
    assert prepared.shared["num_sequences"] == 6
    # rank 0 trains rows 0, 2, 3 and rank 1 rows 5, 6, 7; mini-batches of 4 = 2 rows of each rank
    assert prepared.shared["minibatches"] == [(1 + 3 + 1 + 2, 4), (4 + 5, 2)]
    for name in ("prompt_ids_B_P", "completion_ids_B_C", "logprobs_B_C"):
        torch.testing.assert_close(prepared.batch[name], getattr(_rollout(), name)[KEPT], rtol=0, atol=0, msg=name)


def test_prepare_update_trims_rows_that_do_not_split_over_the_ranks_without_counting_them_stale(
    tiny_model_dir: Path,
) -> None:
    versions = [2, 0, 2, 2, 2, 2, 2, 2]  # one stale row: 7 kept, 6 split over 2 ranks

    prepared = prepare_update(_rollout(versions), _config(tiny_model_dir, mini_batch_size=None), TRAINER_VERSION)

    assert prepared.stale == 1
    assert prepared.index_B.tolist() == [0, 2, 3, 4, 5, 6]
    assert prepared.shared["num_tokens"] == 1 + 3 + 4 + 5 + 1 + 2
    assert prepared.shared["num_sequences"] == 6
    assert prepared.shared["minibatches"] == [(16, 6)]


@pytest.mark.parametrize(
    ("scale_rewards", "expected"),
    [
        # group rewards [1, 0, 0, 0] and [2, 1, 0, 1]: minus the group mean ...
        (False, [0.75, -0.25, -0.25, -0.25, 1.0, 0.0, -1.0, 0.0]),
        # ... and divided by the group's population std, sqrt(3) / 4 and sqrt(1 / 2)
        (True, [3**0.5, -(3**-0.5), -(3**-0.5), -(3**-0.5), 2**0.5, 0.0, -(2**0.5), 0.0]),
    ],
)
def test_prepare_update_honours_scale_rewards_over_the_whole_rollout(
    tiny_model_dir: Path, scale_rewards: bool, expected: list[float]
) -> None:
    prepared = prepare_update(_rollout(), _config(tiny_model_dir, scale_rewards=scale_rewards), TRAINER_VERSION)

    expected_B = torch.tensor(expected)
    torch.testing.assert_close(prepared.advantages_B, expected_B, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(prepared.batch["advantages_B"], expected_B[KEPT], rtol=1e-5, atol=1e-6)


def test_prepare_update_reports_the_mean_reward_of_the_whole_rollout_stale_rows_included(
    tiny_model_dir: Path,
) -> None:
    prepared = prepare_update(_rollout(), _config(tiny_model_dir), TRAINER_VERSION)

    assert prepared.reward_mean == pytest.approx(5.0 / 8.0, rel=1e-7, abs=0.0)


def test_prepare_update_compares_trainer_and_engine_only_on_rows_of_the_trainer_version(tiny_model_dir: Path) -> None:
    prepared = prepare_update(_rollout(), _config(tiny_model_dir), TRAINER_VERSION)

    agreement_B_C = prepared.batch["agreement_mask_B_C"]
    mask_B_C = prepared.batch["completion_mask_B_C"]
    assert not agreement_B_C[0].any()  # row 0 came from v1
    assert torch.equal(agreement_B_C[1:], mask_B_C[1:])


def test_update_batch_bodies_give_each_rank_its_rows_and_the_shared_normalisers(tiny_model_dir: Path) -> None:
    prepared = prepare_update(_rollout(), _config(tiny_model_dir), TRAINER_VERSION)

    bodies = prepared.bodies(2, [{"rank": 0}, {"rank": 1}])

    for rank, body in enumerate(bodies):
        assert body["rank"] == rank
        assert body["minibatches"] == prepared.shared["minibatches"]
        assert body["num_tokens"] == 16 and body["num_sequences"] == 6
        rows = KEPT[3 * rank : 3 * rank + 3]
        torch.testing.assert_close(body["shard"]["advantages_B"], prepared.advantages_B[rows], rtol=0, atol=0)


def test_prepare_update_with_stale_policy_raise_raises_naming_the_stale_versions(tiny_model_dir: Path) -> None:
    with pytest.raises(StaleRolloutError, match="v0: 2 samples"):
        prepare_update(_rollout(), _config(tiny_model_dir, policy="raise"), TRAINER_VERSION)


def test_prepare_update_with_every_row_stale_raises_version_error(tiny_model_dir: Path) -> None:
    with pytest.raises(VersionError, match="no sample left to train on: 8 stale samples dropped"):
        prepare_update(_rollout([0] * 8), _config(tiny_model_dir), TRAINER_VERSION)


def test_sft_bodies_give_each_rank_its_rows_the_whole_batch_token_count_and_the_step_lr() -> None:
    from rlsdk.train_batches import sft_bodies

    mask_B_C = torch.arange(3)[None, :] < torch.tensor([1, 3, 2, 2])[:, None]
    tensors = {
        "prompt_ids_B_P": torch.arange(8).reshape(4, 2),
        "prompt_mask_B_P": torch.ones(4, 2, dtype=torch.bool),
        "completion_ids_B_C": torch.arange(12).reshape(4, 3),
        "completion_mask_B_C": mask_B_C,
    }

    bodies = sft_bodies(tensors, 0.5, 2, lambda world, next_request: [{"rank": r} for r in range(world)])
    default = sft_bodies(tensors, None, 2, lambda world, next_request: [{} for _ in range(world)])

    assert [(b["rank"], b["lr"], b["num_tokens"]) for b in bodies] == [(0, 0.5, 8), (1, 0.5, 8)]
    assert [b["lr"] for b in default] == [None, None]
    for rank, body in enumerate(bodies):
        torch.testing.assert_close(
            body["shard"]["completion_ids_B_C"], tensors["completion_ids_B_C"][2 * rank : 2 * rank + 2], rtol=0, atol=0
        )
