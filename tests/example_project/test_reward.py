"""The reward on plain strings and on text decoded by the tiny policy's tokenizer."""

from __future__ import annotations

from typing import Any

import torch
from my_rewards import exact_match

from rlsdk.testing import assert_close


def test_exact_match_mixed_batch_scores_each_completion() -> None:
    rewards_B = torch.tensor(exact_match(["321", " 321 ", "123"], ["321", "321", "321"]))

    assert_close(rewards_B, torch.tensor([1.0, 1.0, 0.0]), rtol=0.0, atol=0.0)


def test_exact_match_tokenizer_round_trip_scores_one(tiny_model_and_tokenizer: tuple[Any, Any]) -> None:
    _, tokenizer = tiny_model_and_tokenizer
    text = tokenizer.decode(tokenizer("321").input_ids, skip_special_tokens=True).replace(" ", "")

    assert exact_match([text], ["321"]) == [1.0]
