"""Staleness policy and the version ledger."""

from __future__ import annotations

import pytest
import torch

from rlsdk.versioning import StaleRolloutError, VersionError, VersionLedger, staleness_mask


def test_staleness_mask_raise_policy_with_stale_samples_raises_naming_versions() -> None:
    versions_B = torch.tensor([3, 3, 1, 2])

    with pytest.raises(StaleRolloutError) as info:
        staleness_mask(versions_B, trainer_version=3, max_staleness=1, policy="raise")

    assert info.value.stale_versions == {1: 1}
    assert "v3" in str(info.value) and "v1: 1 samples" in str(info.value)


def test_staleness_mask_drop_policy_keeps_only_fresh_samples() -> None:
    versions_B = torch.tensor([3, 3, 1, 2])

    keep_B = staleness_mask(versions_B, trainer_version=3, max_staleness=1, policy="drop")

    assert keep_B.tolist() == [True, True, False, True]


def test_staleness_mask_sample_newer_than_trainer_raises_version_error() -> None:
    with pytest.raises(VersionError, match="newer than the trainer"):
        staleness_mask(torch.tensor([5]), trainer_version=4, max_staleness=0, policy="raise")


def test_version_ledger_state_dict_round_trip_preserves_syncs() -> None:
    ledger = VersionLedger(trainer_version=2)
    ledger.record_sync(2, "abc", 0.01)

    restored = VersionLedger.from_state_dict(ledger.state_dict())

    assert restored == ledger
    assert restored.in_sync
