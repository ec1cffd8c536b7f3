"""Weight versions: the ledger of what the trainer published and the engine serves, and the staleness policy.

A version is an integer per policy: 0 for the initial weights, +1 for every update the train engine publishes.
One ``Session.update`` is one published version, however many optimizer steps it runs (``train.ppo_epochs`` x
mini-batches): the engine only ever serves what a sync publishes, so the optimizer steps inside an update have
no version of their own. With LoRA (``train.lora_rank``) the version names the adapter the trainer published,
on the base weights both sides loaded from ``model.path``. Every generated token records the version that
produced it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch


class VersionError(RuntimeError):
    """Weights or samples do not carry the version the contract requires."""


class StaleRolloutError(VersionError):
    """A batch holds samples older than ``max_staleness`` allows."""

    def __init__(self, trainer_version: int, max_staleness: int, stale_versions: dict[int, int]) -> None:
        self.trainer_version = trainer_version
        self.max_staleness = max_staleness
        self.stale_versions = stale_versions
        detail = ", ".join(f"v{v}: {n} samples" for v, n in sorted(stale_versions.items()))
        super().__init__(
            f"rollout is stale: trainer is at v{trainer_version} and rollout.max_staleness={max_staleness} "
            f"allows behaviour versions >= v{trainer_version - max_staleness}, but the batch holds {detail}. "
            "Generate a new rollout after sync_weights(), raise rollout.max_staleness, "
            "or set rollout.stale_policy='drop'."
        )


class WeightMismatchError(VersionError):
    """The engine does not serve the weights the trainer published."""


@dataclass
class SyncRecord:
    version: int
    checksum: str
    seconds: float
    time: float = field(default_factory=time.time)


@dataclass
class VersionLedger:
    """Who holds which version. The Session owns one; checkpoints store it.

    ``trainer_version`` counts published updates (+1 per ``Session.update``, whatever its number of optimizer
    steps); ``trainer_checksum`` / ``engine_checksum`` are of the full weights, or of the adapter tensors only when
    the run trains LoRA adapters (``train.lora_rank > 0``)."""

    trainer_version: int = 0
    engine_version: int = 0
    trainer_checksum: str | None = None
    engine_checksum: str | None = None
    syncs: list[SyncRecord] = field(default_factory=list)
    dropped_stale_samples: int = 0

    @property
    def in_sync(self) -> bool:
        return self.trainer_version == self.engine_version

    def record_sync(self, version: int, checksum: str, seconds: float) -> None:
        self.engine_version = version
        self.engine_checksum = checksum
        self.syncs.append(SyncRecord(version, checksum, seconds))

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> VersionLedger:
        syncs = [SyncRecord(**s) for s in state.get("syncs", [])]
        return cls(**{**state, "syncs": syncs})


def staleness_mask(
    behaviour_versions_B: torch.Tensor,
    trainer_version: int,
    max_staleness: int,
    policy: Literal["raise", "drop"],
) -> torch.Tensor:
    """Which samples may be trained on: ``trainer_version - behaviour_version <= max_staleness``.

    ``behaviour_versions_B`` holds each sample's oldest token version. Returns a bool mask ``keep_B``.
    Raises :class:`StaleRolloutError` naming the versions when ``policy == "raise"`` and any sample is stale,
    and :class:`VersionError` for a behaviour version newer than the trainer (a bookkeeping bug).
    """
    if behaviour_versions_B.dim() != 1:
        raise ValueError(f"behaviour_versions_B must be 1-D, got shape {tuple(behaviour_versions_B.shape)}")
    newest = int(behaviour_versions_B.max()) if behaviour_versions_B.numel() else trainer_version
    if newest > trainer_version:
        raise VersionError(f"rollout holds samples from v{newest}, newer than the trainer's v{trainer_version}")
    keep_B = behaviour_versions_B >= trainer_version - max_staleness
    if policy == "raise" and not bool(keep_B.all()):
        versions, counts = torch.unique(behaviour_versions_B[~keep_B], return_counts=True)
        stale = {int(v): int(c) for v, c in zip(versions, counts)}
        raise StaleRolloutError(trainer_version, max_staleness, stale)
    return keep_B
