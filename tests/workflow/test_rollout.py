"""Rollout shape checks, behaviour versions and prompt normalisation."""

from __future__ import annotations

import pytest
import torch

from rlsdk.engine.inference.sampling import left_pad
from rlsdk.workflow.rollout import Rollout, normalize_rows


def _rollout(versions_B_C: torch.Tensor, mask_B_C: torch.Tensor) -> Rollout:
    batch, width = mask_B_C.shape
    prompt_ids_B_P, prompt_mask_B_P = left_pad([[1, 2]] * batch, pad_token_id=0)
    return Rollout(
        rows=[{"prompt": "12>", "answer": "21"}] * (batch // 2),
        group_size=2,
        prompt_ids_B_P=prompt_ids_B_P,
        prompt_mask_B_P=prompt_mask_B_P,
        completion_ids_B_C=torch.ones(batch, width, dtype=torch.long),
        completion_mask_B_C=mask_B_C,
        logprobs_B_C=torch.zeros(batch, width),
        versions_B_C=versions_B_C,
        completions=["21"] * batch,
    )


def test_rollout_behaviour_versions_take_oldest_unmasked_token() -> None:
    mask_B_C = torch.tensor([[True, True, False], [True, True, True]])
    versions_B_C = torch.tensor([[2, 3, -1], [3, 3, 3]])

    rollout = _rollout(versions_B_C, mask_B_C)

    assert rollout.behaviour_versions_B.tolist() == [2, 3]
    assert rollout.versions == [2, 3]


def test_rollout_columns_repeat_each_row_per_sample() -> None:
    rollout = _rollout(torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.bool))

    assert rollout.columns()["answer"] == ["21"] * 4


def test_rollout_with_mismatched_shapes_raises_naming_tensor() -> None:
    with pytest.raises(ValueError, match="logprobs_B_C"):
        Rollout(
            rows=[{"prompt": "1>"}],
            group_size=1,
            prompt_ids_B_P=torch.ones(1, 2, dtype=torch.long),
            prompt_mask_B_P=torch.ones(1, 2, dtype=torch.bool),
            completion_ids_B_C=torch.ones(1, 3, dtype=torch.long),
            completion_mask_B_C=torch.ones(1, 3, dtype=torch.bool),
            logprobs_B_C=torch.zeros(1, 2),
            versions_B_C=torch.zeros(1, 3, dtype=torch.long),
            completions=["x"],
        )


def test_left_pad_left_pads_and_masks() -> None:
    ids_B_P, mask_B_P = left_pad([[5, 6, 7], [8]], pad_token_id=0)

    assert ids_B_P.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask_B_P.tolist() == [[True, True, True], [False, False, True]]


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([""], "non-empty string"),
        ([{"text": "x"}], "no 'prompt' key"),
        ([3], "allowed: str or a dict"),
        ({"text": ["x"]}, "needs a 'prompt' column"),
    ],
)
def test_normalize_rows_bad_prompts_raise_naming_the_item(prompts: object, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        normalize_rows(prompts)


def test_normalize_rows_accepts_column_batch() -> None:
    rows = normalize_rows({"prompt": ["1>", "2>"], "answer": ["1", "2"]})

    assert rows == [{"prompt": "1>", "answer": "1"}, {"prompt": "2>", "answer": "2"}]
