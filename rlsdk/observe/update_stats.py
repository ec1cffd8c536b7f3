"""An RL update's metrics as one namespaced dict (``reward/*``, ``train/*``, ``agreement/*``, ``completion/*``,
``time/*``, ``throughput/*``, ``version/*``, and ``dynamic_sampling`` counts): what ``Session.update`` returns and
logs; likewise an SFT step's (``sft/*``) for ``Session.sft_update``. Pure functions of the rollout or batch, the
ranks' results and the versions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlsdk.observe.rollout_metrics import (
    completion_metrics,
    reward_metrics,
    sft_metrics,
    throughput_metrics,
    update_metrics,
)
from rlsdk.versioning import VersionLedger
from rlsdk.workflow.rollout import Rollout


def update_step_metrics(
    rollout: Rollout,
    results: list[dict[str, Any]],
    prepared: Any,
    config: Any,
    versions: VersionLedger,
    eos_token_ids: Sequence[int],
    *,
    step: int,
    update_s: float,
) -> dict[str, float]:
    """An update's metrics (``prepared``: its :class:`~rlsdk.train_batches.UpdateBatch`; ``config``: the
    SessionConfig): the rollout's rewards and completions, the ranks' ``train/*`` and ``agreement/*``
    (:func:`~rlsdk.observe.rollout_metrics.update_metrics`), timings, throughput and versions."""
    rollout_s = float(rollout.info.get("seconds", float("nan")))
    ranks = update_metrics(results, world=config.launch.num_ranks)
    return {
        "step": float(step),
        **reward_metrics(rollout),  # mean, std and each combine_rewards() component
        **ranks,
        "train/dropped_stale": float(prepared.stale),
        "train/used_samples": float(prepared.index_B.numel()),
        "time/update_s": update_s,
        "time/rollout_s": rollout_s,
        "time/reward_s": float(rollout.info.get("reward_seconds", float("nan"))),
        **completion_metrics(rollout, max_new_tokens=config.rollout.max_new_tokens, eos_token_ids=eos_token_ids),
        **throughput_metrics(
            rollout_tokens=float(rollout.completion_mask_B_C.sum()),
            rollout_s=rollout_s,
            update_tokens=ranks["train/tokens"],
            update_s=update_s,
        ),
        "version/trainer": float(versions.trainer_version),
        "version/engine": float(versions.engine_version),
        "version/behaviour_min": float(rollout.behaviour_versions_B.min()),
        **{k: float(v) for k, v in rollout.info.get("dynamic_sampling", {}).items()},
    }


def sync_metrics(info: Any, seconds: float) -> dict[str, float]:
    """A weight sync's metrics (``info``: the engine's ``WeightInfo``): its time, the version served, and the bytes
    it moved where the engine reports them (a LoRA run: the adapter only)."""
    stats = {"time/sync_s": seconds, "version/engine": float(info.version)}
    if info.bytes is not None:
        stats["sync/bytes"] = float(info.bytes)
    return stats


def sft_step_metrics(
    results: Sequence[dict[str, float]], *, step: int, seconds: float, versions: VersionLedger
) -> dict[str, float]:
    """An SFT step's metrics: the ranks' ``sft/*`` (:func:`~rlsdk.observe.rollout_metrics.sft_metrics`), its
    throughput and the versions."""
    return {
        "step": float(step),
        **sft_metrics(results, seconds=seconds),
        "version/trainer": float(versions.trainer_version),
        "version/engine": float(versions.engine_version),
    }
