"""Which rows of a rollout an update trains on, and how they are split over the ranks: pure tensor functions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def trainable_indices(keep_B: torch.Tensor, world: int) -> tuple[torch.Tensor, int]:
    """The rows an update trains on: those ``keep_B`` keeps (not too stale), the last few dropped so that every
    one of ``world`` ranks gets the same number (equal shards: every rank runs the same collectives). Returns
    ``(index_B, stale)``: the row indices and how many rows ``keep_B`` dropped (the trimmed ones not counted)."""
    index_B = keep_B.nonzero().flatten()
    stale = keep_B.numel() - index_B.numel()
    return index_B[: index_B.numel() - index_B.numel() % world], stale


def update_tensors(rollout: Any, advantages_B: torch.Tensor, index_B: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of ``rollout`` (a :class:`~rlsdk.workflow.rollout.Rollout`) an update sends to the ranks, rows
    ``index_B`` only, with the advantages computed over the whole rollout."""
    # What the trainer's forward attends to: the engine's context (tool outputs of a multi-turn rollout
    # included), a superset of the trained tokens.
    attention_B_C = rollout.completion_mask_B_C if rollout.attention_mask_B_C is None else rollout.attention_mask_B_C
    return {
        "prompt_ids_B_P": rollout.prompt_ids_B_P[index_B],
        "prompt_mask_B_P": rollout.prompt_mask_B_P[index_B],
        "completion_ids_B_C": rollout.completion_ids_B_C[index_B],
        "completion_mask_B_C": rollout.completion_mask_B_C[index_B],
        "completion_attention_mask_B_C": attention_B_C[index_B],
        "logprobs_B_C": rollout.logprobs_B_C[index_B],
        "advantages_B": advantages_B[index_B],
    }


def shard_rows(tensors: Mapping[str, torch.Tensor], world: int) -> list[dict[str, torch.Tensor]]:
    """Split every tensor's rows into ``world`` equal consecutive shards (rank r gets shard r); the row count
    must be a multiple of ``world`` (see :func:`trainable_indices`)."""
    rows = next(iter(tensors.values())).shape[0]
    if rows % world:
        raise ValueError(f"{rows} rows cannot be split evenly over {world} ranks")
    per_rank = rows // world
    return [{k: v[r * per_rank : (r + 1) * per_rank] for k, v in tensors.items()} for r in range(world)]
