"""Which rows an update trains on and how they are split over the ranks."""

from __future__ import annotations

import pytest
import torch

from rlsdk.algorithms.batching import shard_rows, trainable_indices


def test_trainable_indices_with_stale_rows_drops_them_and_trims_to_equal_shards() -> None:
    keep_B = torch.tensor([True, False, True, True, True, False, True])

    index_B, stale = trainable_indices(keep_B, world=2)

    assert index_B.tolist() == [0, 2, 3, 4]  # 5 kept, the last trimmed so both ranks get 2
    assert stale == 2


def test_trainable_indices_when_every_row_is_stale_returns_none() -> None:
    index_B, stale = trainable_indices(torch.zeros(4, dtype=torch.bool), world=2)

    assert index_B.numel() == 0
    assert stale == 4


def test_shard_rows_gives_rank_r_the_r_th_consecutive_block_of_every_tensor() -> None:
    tensors = {"a_B": torch.arange(6), "b_B_C": torch.arange(12).reshape(6, 2)}

    shards = shard_rows(tensors, world=3)

    assert [s["a_B"].tolist() for s in shards] == [[0, 1], [2, 3], [4, 5]]
    torch.testing.assert_close(shards[2]["b_B_C"], torch.tensor([[8, 9], [10, 11]]), rtol=0, atol=0)


def test_shard_rows_with_uneven_rows_raises_naming_the_counts() -> None:
    with pytest.raises(ValueError, match="5 rows cannot be split evenly over 2 ranks"):
        shard_rows({"a_B": torch.arange(5)}, world=2)
