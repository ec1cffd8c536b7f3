"""The weights checksum: XXH3-128 with a versioned prefix; BLAKE3 and SHA-256 values recorded before still verify."""

from __future__ import annotations

import hashlib

import pytest
import torch

from rlsdk.engine.weights import checksum_algorithm, checksum_matches, state_dict_checksum


def _state_dict() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "b.weight": torch.randn(4, 3, generator=generator),
        "a.bias": torch.randn(3, generator=generator),
        "empty": torch.zeros(0),
    }


def test_state_dict_checksum_defaults_to_prefixed_xxh3_and_changes_with_one_bit() -> None:
    state_dict = _state_dict()
    checksum = state_dict_checksum(state_dict)
    flipped = dict(state_dict, **{"a.bias": state_dict["a.bias"].clone()})
    flipped["a.bias"].view(torch.int32)[0] ^= 1

    assert checksum.startswith("xxh3:") and len(checksum) == len("xxh3:") + 32
    assert checksum_algorithm(checksum) == "xxh3"
    assert state_dict_checksum(dict(reversed(state_dict.items()))) == checksum  # sorted name order
    assert state_dict_checksum(flipped) != checksum


def test_sha256_checksum_keeps_the_legacy_bare_hex_format_of_older_checkpoints() -> None:
    state_dict = _state_dict()
    legacy = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name]
        legacy.update(name.encode())
        legacy.update(str(tensor.dtype).encode())
        legacy.update(str(tuple(tensor.shape)).encode())
        legacy.update(tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b"")

    assert state_dict_checksum(state_dict, "sha256") == legacy.hexdigest()
    assert checksum_algorithm(legacy.hexdigest()) == "sha256"


def test_checksum_matches_recomputes_with_the_algorithm_the_stored_value_names() -> None:
    state_dict = _state_dict()
    other = {name: tensor + 1 for name, tensor in state_dict.items()}

    assert checksum_matches(state_dict, state_dict_checksum(state_dict, "sha256"))
    assert checksum_matches(state_dict, state_dict_checksum(state_dict, "blake3"))
    assert not checksum_matches(other, state_dict_checksum(state_dict, "sha256"))
    assert not checksum_matches(other, state_dict_checksum(state_dict, "blake3"))
    assert checksum_matches(state_dict, state_dict_checksum(state_dict, "xxh3"))
    assert not checksum_matches(other, state_dict_checksum(state_dict, "xxh3"))


def test_blake3_checksum_keeps_its_prefixed_format_of_older_checkpoints() -> None:
    checksum = state_dict_checksum(_state_dict(), "blake3")

    assert checksum.startswith("blake3:") and len(checksum) == len("blake3:") + 64
    assert checksum_algorithm(checksum) == "blake3"


@pytest.mark.parametrize("value", ["md5:abc", "ABCDEF", "", "blake2:" + "0" * 64, "xxh64:" + "0" * 16])
def test_checksum_algorithm_of_an_unknown_format_raises_value_error_naming_it(value: str) -> None:
    with pytest.raises(ValueError, match="expected 'xxh3:<hex>', 'blake3:<hex>' or a 64-hex SHA-256 digest"):
        checksum_algorithm(value)


def test_state_dict_checksum_with_unknown_algorithm_raises_value_error() -> None:
    with pytest.raises(ValueError, match="'md5'"):
        state_dict_checksum(_state_dict(), "md5")  # type: ignore[arg-type]
