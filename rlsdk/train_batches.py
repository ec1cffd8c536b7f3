"""What the controller sends the ranks for one optimizer step: an RL update's batch (staleness filter, advantages,
the rows each rank trains on) and an SFT step's bodies. Pure functions of the rollout/batch and the config; the
Session's ``update()``/``sft_update()`` broadcast what these return."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlsdk.config import SessionConfig
from rlsdk.observe.rollout_metrics import current_rows_B_C
from rlsdk.versioning import VersionError, staleness_mask
from rlsdk.workflow.rollout import Rollout


@dataclass
class UpdateBatch:
    """An RL update's tensors (rows kept, plus ``agreement_mask_B_C``), its sizes, and what was dropped."""

    batch: dict[str, torch.Tensor]
    shared: dict[str, Any]  # every rank's body: num_tokens, num_sequences, minibatches
    index_B: torch.Tensor  # the rollout's rows trained on
    advantages_B: torch.Tensor  # over the whole rollout (stale samples included)
    stale: int  # samples dropped as too stale
    reward_mean: float  # over the whole rollout

    def bodies(self, world: int, fields: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each rank's ``update`` body: its even share of the rows, the shared sizes and the engine's fields."""
        from rlsdk.algorithms.batching import shard_rows

        shards = shard_rows(self.batch, world)
        return [{"shard": shard, **self.shared, **fields[r]} for r, shard in enumerate(shards)]


def prepare_update(rollout: Rollout, config: SessionConfig, trainer_version: int) -> UpdateBatch:
    """The batch an update trains on. Samples staler than ``rollout.max_staleness`` raise ``StaleRolloutError``
    (policy ``raise``) or are dropped (policy ``drop``); raises ``VersionError`` when no sample is left for every
    rank, and ``ValueError`` for a rollout without rewards."""
    from rlsdk.algorithms import compute_advantages
    from rlsdk.algorithms.batching import trainable_indices, update_tensors
    from rlsdk.engine.train.schedule import minibatch_normalisers

    if rollout.rewards_B is None:
        raise ValueError("rollout has no rewards: call `rollout = await session.reward(rollout, fn)` first")
    world = config.launch.num_ranks
    keep_B = staleness_mask(
        rollout.behaviour_versions_B, trainer_version, config.rollout.max_staleness, config.rollout.stale_policy
    )
    # Over the whole rollout, stale samples included: the group and batch statistics see every sample.
    # (DAPO's dynamic sampling already ran in reward(), see rollout.dynamic_sampling.)
    advantages_B = compute_advantages(
        rollout.rewards_B,
        rollout.group_size,
        config.algorithm.resolved().advantage or "grpo",
        scale_by_std=config.algorithm.scale_rewards,
        eps=config.algorithm.adv_eps,
    )
    index_B, stale = trainable_indices(keep_B, world)
    if index_B.numel() == 0:
        raise VersionError(
            f"no sample left to train on: {stale} stale samples dropped and {world} ranks need at least one "
            f"sample each (trainer v{trainer_version}, max_staleness {config.rollout.max_staleness})"
        )
    batch = update_tensors(rollout, advantages_B, index_B)
    # Trainer and engine are compared only on rows the trainer's own weights sampled wholly (agreement/*).
    batch["agreement_mask_B_C"] = current_rows_B_C(rollout, trainer_version)[index_B]
    shared = {
        "num_tokens": int(batch["completion_mask_B_C"].sum()),
        "num_sequences": index_B.numel(),
        "minibatches": minibatch_normalisers(batch["completion_mask_B_C"], world, config.train.mini_batch_size),
    }
    return UpdateBatch(batch, shared, index_B, advantages_B, stale, float(rollout.rewards_B.mean()))


def sft_tensors(batch: Any, lr: float | None, *, tokenizer: Any, special_tokens: Any, world: int) -> dict[str, Any]:
    """An SFT step's checked tensors: rows (``prompt``/``completion``) are tokenized and collated first. Raises
    ``ValueError`` for a malformed batch, a row count that is not a positive multiple of ``world``, or a bad
    ``lr``."""
    from rlsdk.data.sft import check_sft_batch, collate_sft, tokenize_sft

    if isinstance(batch, (list, tuple)):
        examples = tokenize_sft(batch, tokenizer, eos_token_ids=special_tokens.eos_token_ids)
        batch = collate_sft(examples, special_tokens.pad_token_id)
    if lr is not None and not (isinstance(lr, (int, float)) and lr > 0 and lr != float("inf")):
        raise ValueError(f"lr={lr!r} is invalid: allowed None or a finite float > 0")
    tensors = check_sft_batch(batch)
    rows = tensors["completion_ids_B_C"].shape[0]
    if rows % world:
        raise ValueError(
            f"an SFT batch of {rows} rows cannot be split evenly over launch.num_ranks={world} ranks: use a "
            f"multiple of {world} (every rank runs the same number of forward/backward passes)"
        )
    return tensors


def sft_bodies(
    tensors: dict[str, Any], lr: float | None, world: int, train_fields: Callable[..., Sequence[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Each rank's ``sft_update`` body: its even share of the rows, the batch's token count (the loss is the token
    mean over the whole batch), the step's ``lr`` and the engine's per-rank fields."""
    from rlsdk.algorithms.batching import shard_rows

    num_tokens = int(tensors["completion_mask_B_C"].sum())
    fields = train_fields(world, lambda: None)
    return [
        {"shard": shard, "num_tokens": num_tokens, "lr": None if lr is None else float(lr), **fields[r]}
        for r, shard in enumerate(shard_rows(tensors, world))
    ]
